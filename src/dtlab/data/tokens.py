"""Token files in nanoGPT's format: `train.bin` and `val.bin`, flat arrays of token ids
(memory-mapped), as `dtlab prepare` writes them.

An optional `meta.json` may give `vocab_size` and `dtype` (uint16, the default, or uint32 for
vocabularies over 65,536); every token id must be below `model.vocab_size`. `dtlab prepare` also
records each split's token count and, since issue 26, each file's bytes and sha256 (`files`):
a file whose size differs (truncated, or from another prepare run: a uint32 train.bin beside a
uint16 meta.json) is refused before any rank starts, and so is one whose sha256 differs, for
files up to VERIFY_BYTES (larger ones are checked by size; `sha256sum` compares by hand).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dtlab.errors import DataError
from dtlab.files import file_sha256

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Token files up to this size are hashed at train start: sha256 of 256 MB from the page cache
# took 0.36 s on a shared 2-core machine (the pass for the largest token id, 0.02 s). Larger files
# are checked by size, which finds truncation and files of another prepare run of another length.
VERIFY_BYTES = 256 << 20


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


def _recorded(folder: Path, split: str, dtype: type) -> tuple[int | None, str | None, str]:
    """What meta.json says `split`.bin holds: (bytes, sha256, how it says it); (None, None, '')
    when it does not say (no meta.json, or one written by hand or by an older dtlab)."""
    try:
        meta = json.loads((Path(folder) / "meta.json").read_bytes().decode())
    except (OSError, ValueError):
        return None, None, ""

    def part(key: str, name: str) -> object:
        inner = meta.get(key) if isinstance(meta, dict) else None
        return inner.get(name) if isinstance(inner, dict) else None

    entry = part("files", f"{split}.bin")
    if isinstance(entry, dict) and _whole(entry.get("bytes")):
        sha = entry.get("sha256")
        return entry["bytes"], sha if isinstance(sha, str) else None, "meta.json says"
    count = part("tokens", split)
    if _whole(count):
        width = np.dtype(dtype).itemsize
        return count * width, None, f"meta.json's {count:,} {np.dtype(dtype).name} tokens make"
    return None, None, ""


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_recorded(folder: Path, split: str, verify: bool = True) -> None:
    """`split`.bin is the file meta.json describes: its size, and (verify, up to VERIFY_BYTES)
    its sha256. A DataError naming the file and the fix otherwise."""
    path = Path(folder) / f"{split}.bin"
    _, dtype = read_meta(Path(folder) / "meta.json")
    size, sha, says = _recorded(folder, split, dtype)
    fix = (f"fix: re-run `dtlab prepare` on the same inputs with --out {Path(folder)} (meta.json "
           "lists them under sources)")
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise DataError(f"{path} holds {actual:,} bytes and {says} {size:,}: it is truncated or "
                        f"from another prepare run, and would be read as the wrong tokens; {fix}")
    if verify and sha is not None and actual <= VERIFY_BYTES and file_sha256(path) != sha:
        raise DataError(f"{path} does not match the sha256 in meta.json: it was changed or "
                        f"mixed with another data set after dtlab prepare wrote it; {fix}")


def check_dataset(folder: Path) -> None:
    """Before any rank starts: both token files are there, meta.json is readable, and each
    file is the one meta.json describes (check_recorded)."""
    for split in ("train", "val"):
        check_file(folder, split)
    read_meta(Path(folder) / "meta.json")
    for split in ("train", "val"):
        check_recorded(folder, split)


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
    check_recorded(folder, split, verify=False)  # every rank: the size (check_dataset hashed)
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
