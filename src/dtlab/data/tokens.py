"""Token files in nanoGPT's format: `train.bin` and `val.bin`, flat arrays of token ids
(memory-mapped), as `dtlab prepare` writes them.

An optional `meta.json` may give `vocab_size` and `dtype` (uint16, the default, or uint32 for
vocabularies over 65,536); every token id must be below `model.vocab_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dtlab.errors import DataError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def read_meta(meta: Path) -> tuple[int | None, type]:
    """meta.json's (vocab_size, dtype); (None, uint16) without the file; a damaged file is a
    DataError."""
    if not meta.is_file():
        return None, np.uint16
    try:
        data = json.loads(meta.read_bytes().decode())
    except ValueError:
        data = None
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    dtype = data.get("dtype", "uint16") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not (vocab is None or (isinstance(vocab, int) and vocab > 0)) \
            or dtype not in DTYPES:
        raise DataError(f"{meta} is not a JSON object with a positive whole vocab_size and a dtype "
                        'of uint16 or uint32; fix: write e.g. {"vocab_size": 50304, "dtype": '
                        '"uint16"}, or remove the file')
    return vocab, DTYPES[dtype]


def check_file(folder: Path, split: str) -> Path:
    path = Path(folder) / f"{split}.bin"
    if not path.is_file():
        raise DataError(
            f"token file {path} not found; fix: write it with `dtlab prepare TEXT --out "
            f"{Path(folder)}`, or point data.dir at a directory holding {split}.bin"
        )
    return path


def open_split(folder: Path, split: str, vocab_size: int, seq_len: int,
               vocab_key: str = "model.vocab_size") -> np.ndarray:
    """A split's tokens, memory-mapped; every id below `vocab_size` (the config key `vocab_key`
    sets it)."""
    path = check_file(folder, split)
    declared, dtype = read_meta(Path(folder) / "meta.json")
    width = np.dtype(dtype).itemsize
    if path.stat().st_size % width:
        raise DataError(f"{path} is not a whole number of {np.dtype(dtype).name} tokens "
                        f"({path.stat().st_size} bytes); fix: rewrite it, or correct meta.json's dtype")
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        raise DataError(f"{path} is empty; fix: write it with `dtlab prepare TEXT --out "
                        f"{Path(folder)}`")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
            "fix: use more data or a smaller model.block_size"
        )
    top = int(tokens.max())
    if top >= vocab_size or (declared is not None and declared > vocab_size):
        raise DataError(
            f"{path} uses token ids up to {max(top, (declared or 0) - 1)} but {vocab_key}="
            f"{vocab_size}; fix: set {vocab_key} to at least {max(top + 1, declared or 0)}"
        )
    return tokens
