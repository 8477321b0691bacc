"""Token files in nanoGPT's format: `train.bin` and `val.bin`, flat uint16 arrays (memory-mapped).

An optional `meta.json` may give `vocab_size`; every token id must be below `model.vocab_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dtlab.errors import DataError


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
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
            "fix: use more data or a smaller model.block_size"
        )
    meta = Path(folder) / "meta.json"
    declared = json.loads(meta.read_text()).get("vocab_size") if meta.is_file() else None
    top = int(tokens.max())
    if top >= vocab_size or (declared is not None and declared > vocab_size):
        raise DataError(
            f"{path} uses token ids up to {max(top, (declared or 0) - 1)} but model.vocab_size="
            f"{vocab_size}; fix: set model.vocab_size to at least {max(top + 1, declared or 0)}"
        )
    return tokens
