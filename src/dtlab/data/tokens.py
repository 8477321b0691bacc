"""Token files in nanoGPT's format: `train.bin` and `val.bin`, flat uint16 arrays (memory-mapped).

An optional `meta.json` may give `vocab_size`; every token id must be below `model.vocab_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dtlab.errors import DataError


def declared_vocab(meta: Path) -> int | None:
    """meta.json's vocab_size, None without the file; a damaged file is a DataError."""
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_bytes().decode())
    except ValueError:
        data = None
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not (vocab is None or (isinstance(vocab, int) and vocab > 0)):
        raise DataError(f"{meta} is not a JSON object with a positive whole vocab_size; fix: "
                        'write e.g. {"vocab_size": 50304}, or remove the file')
    return vocab


def check_file(folder: Path, split: str) -> Path:
    path = Path(folder) / f"{split}.bin"
    if not path.is_file():
        raise DataError(
            f"token file {path} not found; fix: write {split}.bin (uint16 token ids) into data.dir"
        )
    return path


def open_split(folder: Path, split: str, vocab_size: int, seq_len: int) -> np.ndarray:
    path = check_file(folder, split)
    if path.stat().st_size % 2:
        raise DataError(f"{path} has an odd number of bytes, not uint16 tokens; fix: rewrite it")
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        raise DataError(f"{path} is empty; fix: write {split}.bin (uint16 token ids) into data.dir")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
            "fix: use more data or a smaller model.block_size"
        )
    declared = declared_vocab(Path(folder) / "meta.json")
    top = int(tokens.max())
    if top >= vocab_size or (declared is not None and declared > vocab_size):
        raise DataError(
            f"{path} uses token ids up to {max(top, (declared or 0) - 1)} but model.vocab_size="
            f"{vocab_size}; fix: set model.vocab_size to at least {max(top + 1, declared or 0)}"
        )
    return tokens
