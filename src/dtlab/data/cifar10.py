"""CIFAR-10 from its binary distribution: records of 1 label byte + 3072 pixel bytes (no pickle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dtlab.data.download import download, extract_tar
from dtlab.errors import DataError

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
FOLDER = "cifar-10-batches-bin"
FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
RECORD = 1 + 3 * 32 * 32
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def prepare(root: Path, download_ok: bool, url: str = URL, md5: str = MD5) -> Path:
    """Return the folder of .bin files, downloading and extracting the archive if allowed."""
    folder = Path(root) / FOLDER
    missing = [f for files in FILES.values() for f in files if not (folder / f).is_file()]
    if not missing:
        return folder
    if not download_ok:
        raise DataError(
            f"CIFAR-10 not found: {folder / missing[0]} is missing; "
            "fix: set data.download=true, or extract cifar-10-binary.tar.gz into data.dir"
        )
    archive = download(url, Path(root) / Path(url).name, md5)
    extract_tar(archive, Path(root))
    return folder


def read_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 (N, 3, 32, 32) and labels as int64 (N,)."""
    chunks = []
    for name in FILES[split]:
        path = Path(folder) / name
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % RECORD:
            raise DataError(
                f"{path} is truncated or corrupt: {raw.size} bytes is not a whole number of "
                f"{RECORD}-byte CIFAR-10 records; fix: delete it and download again"
            )
        chunks.append(raw.reshape(-1, RECORD))
    records = np.concatenate(chunks)
    labels = records[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise DataError(
            f"{folder}: label {labels.max()} is outside 0-9, the files are corrupt; "
            "fix: delete them and download again"
        )
    images = records[:, 1:].reshape(-1, 3, 32, 32)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels)
