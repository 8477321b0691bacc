"""MNIST from its IDX files (optionally gzipped), verified header by header."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from dtlab.data.download import download
from dtlab.errors import DataError

MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MEAN, STD = (0.1307,), (0.3081,)
_UBYTE = 0x08


def prepare(root: Path, download_ok: bool, mirror: str = MIRROR, md5: dict[str, str] = MD5) -> Path:
    folder = Path(root) / "MNIST"
    for name in (n for pair in FILES.values() for n in pair):
        if (folder / name).is_file() or (folder / f"{name}.gz").is_file():
            continue
        if not download_ok:
            raise DataError(
                f"MNIST not found: {folder / name}(.gz) is missing; "
                "fix: set data.download=true, or put the IDX files into data.dir/MNIST"
            )
        download(mirror + f"{name}.gz", folder / f"{name}.gz", md5[f"{name}.gz"])
    return folder


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read an unsigned-byte IDX array with `ndim` dimensions; checks magic, dims and length."""
    path = Path(path)
    if not path.is_file():
        path = path.with_name(path.name + ".gz")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path} cannot be read ({e}); fix: delete it and download again") from None
    header = 4 + 4 * ndim
    if len(raw) < header or raw[0] != 0 or raw[1] != 0 or raw[2] != _UBYTE or raw[3] != ndim:
        raise DataError(
            f"{path} is not an IDX file of {ndim}-D unsigned bytes (bad header); "
            "fix: delete it and download again"
        )
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise DataError(
            f"{path} is truncated or corrupt: {len(raw)} bytes, the header {dims} needs {expected}; "
            "fix: delete it and download again"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def read_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 (N, 1, 28, 28) and labels as int64 (N,)."""
    img_name, lbl_name = FILES[split]
    images = read_idx(Path(folder) / img_name, 3)
    labels = read_idx(Path(folder) / lbl_name, 1)
    if len(images) != len(labels) or (len(labels) and labels.max() > 9):
        raise DataError(
            f"{folder}: {len(images)} images but {len(labels)} labels (or a label > 9); "
            "fix: delete the MNIST files and download again"
        )
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
