"""Writers for small datasets in the real on-disk formats (CIFAR-10 binary, MNIST IDX, tokens).

Image i carries its own index in its first two pixels (i % 256, i // 256), so a test can tell
which samples a batch holds after the reader, the sampler and the normalisation.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import numpy as np

from dtlab.data import cifar10, mnist


def indexed_images(n: int, shape: tuple[int, ...], start: int = 0) -> np.ndarray:
    rng = np.random.default_rng(start)
    images = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    flat = images.reshape(n, -1)
    ids = np.arange(start, start + n)
    flat[:, 0], flat[:, 1] = ids % 256, ids // 256
    return images


def decode_ids(raw_pixels: np.ndarray) -> list[int]:
    flat = raw_pixels.reshape(len(raw_pixels), -1).astype(np.int64)
    return (flat[:, 0] + 256 * flat[:, 1]).tolist()


def write_cifar10(root: Path, per_file: int = 40, test: int = 30) -> Path:
    """Five training files of `per_file` records and a test file, labels = index % 10."""
    folder = Path(root) / cifar10.FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for name, n in [*((f, per_file) for f in cifar10.FILES["train"]), ("test_batch.bin", test)]:
        images = indexed_images(n, (3, 32, 32), start if name != "test_batch.bin" else 10_000)
        labels = (np.arange(n) + start) % 10
        records = np.concatenate([labels[:, None].astype(np.uint8), images.reshape(n, -1)], axis=1)
        (folder / name).write_bytes(records.tobytes())
        start += n if name != "test_batch.bin" else 0
    return folder


def cifar10_archive(root: Path, dest: Path) -> Path:
    """A cifar-10-binary.tar.gz of the folder written by `write_cifar10`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(Path(root) / cifar10.FOLDER, arcname=cifar10.FOLDER)
    dest.write_bytes(buf.getvalue())
    return dest


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, train: int = 50, test: int = 20, gz: bool = True) -> Path:
    folder = Path(root) / "MNIST"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        img_name, lbl_name = mnist.FILES[split]
        images = indexed_images(n, (28, 28))
        labels = np.arange(n) % 10
        for name, arr in ((img_name, images), (lbl_name, labels)):
            data = idx_bytes(arr)
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return folder
