"""`dtlab prepare INPUT... --out DIR`: text -> `train.bin`, `val.bin` and `meta.json`, the token
directory `data.name=tokens` reads (nanoGPT's layout: flat arrays of token ids).

Inputs: .txt/.md files (one document each), .jsonl (one document per line, its `--text-field`),
.parquet (that column; needs pyarrow), directories of those, or the name of a Hugging Face
dataset when the `datasets` package and the network are there. Every document is encoded, followed
by the tokenizer's end-of-text token when it has one; the last `--val-fraction` of the token stream
is the validation split, as nanoGPT splits it. Large inputs are encoded by `--workers` processes,
in input order (the output does not depend on the worker count). The data set appears whole or
not at all: it is built in a hidden directory beside --out and swapped in complete
(dtlab/atomic_write.py); meta.json records each file's size and sha256, which `train` checks. A
refused write is one line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from dtlab import atomic_write, files
from dtlab.errors import ConfigError, DataError, DtlabError
from dtlab.text import tokenizer as tokenizers

TEXT_SUFFIXES = {".txt", ".md", ".text"}
SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet"}
CHUNK_CHARS = 1 << 20  # documents go to the workers in chunks of about 1 MB of text
POOL_FROM_BYTES = 4 << 20  # smaller inputs are encoded in this process
# What a token directory holds (.tokens.tmp: the stream an older dtlab could leave behind).
DATA_SET_FILES = {"train.bin", "val.bin", "meta.json", ".tokens.tmp"}


def input_files(inputs: list[str]) -> list[Path | str]:
    """Files in the order given (a directory: its files with known suffixes, sorted); a name that
    is not a path is a Hugging Face dataset."""
    found: list[Path | str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not inside:
                raise DataError(f"{path} holds no .txt, .md, .jsonl or .parquet file; fix: pass "
                                "the files themselves or a directory that has some")
            found += inside
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"{path}: unknown kind of file '{path.suffix}'; fix: pass .txt, "
                                ".md, .jsonl or .parquet files")
            found.append(path)
        elif "/" in item and not item.startswith((".", "/")) and not path.parent.exists():
            found.append(item)  # owner/name: a dataset on the hub
        else:
            raise DataError(f"{item} not found; fix: pass text files, a directory of them, or "
                            "a Hugging Face dataset name such as roneneldan/TinyStories")
    seen: dict[str, Path] = {}  # one text twice would put its validation part in train.bin too
    for source in found:
        if isinstance(source, Path):
            real = os.path.realpath(source)
            if real in seen:
                raise DataError(f"{source} is the same file as {seen[real]}, given twice (by name, "
                                "inside a directory, or through a link); fix: pass each file once")
            seen[real] = source
    for source in found:  # an unreadable file is found now, not after the rest is encoded
        if isinstance(source, Path):
            try:
                open(source, "rb").close()
            except OSError as e:
                raise DataError(f"{source} cannot be read ({e.strerror}); fix: check its "
                                "permissions (chmod u+r), or leave it out") from None
    return found


def documents(source: Path | str, text_field: str) -> Iterator[str]:
    if isinstance(source, str):
        yield from _hub_documents(source, text_field)
    elif source.suffix == ".jsonl":
        with open(source, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[text_field]
                    if not isinstance(text, str):  # a number or null would become "5", "None"
                        raise TypeError(text_field)
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{source}:{n} is not a JSON object with a '{text_field}' "
                                    "string; fix: repair the line, or name the field with "
                                    "--text-field") from None
                yield text
    elif source.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{source}: reading parquet needs pyarrow; fix: pip install "
                              "pyarrow, or convert the file to .jsonl") from None
        table = pq.read_table(source, columns=[text_field])
        yield from (str(t) for t in table.column(text_field).to_pylist())
    else:
        try:
            yield source.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{source} is not UTF-8 text (byte {e.start}); fix: convert it, "
                            "e.g. iconv -t utf-8") from None


def _hub_documents(name: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{name}: a Hugging Face dataset needs the `datasets` package; fix: pip "
                          "install 'dtlab[datasets]', or pass local text files") from None
    try:
        data = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:  # offline, unknown name, private: the library's own exception types
        raise DataError(f"could not load the dataset {name} ({type(e).__name__}); fix: check "
                        "the name and the network, or pass local text files") from None
    for record in data:
        yield str(record[text_field])


def _chunks(sources: list[Path | str], text_field: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for source in sources:
        for doc in documents(source, text_field):
            chunk.append(doc)
            size += len(doc)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


_worker_tokenizer: tokenizers.Tokenizer | None = None


def _start_worker(name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizers.load(name)


def _encode_in_worker(chunk: list[str]) -> tuple[list[int], int, int]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, chunk)


def _encode(tok: tokenizers.Tokenizer, chunk: list[str]) -> tuple[list[int], int, int]:
    """The chunk's token ids, its UTF-8 bytes (for the progress bar) and its documents."""
    ids: list[int] = []
    for doc in chunk:
        ids += tok.encode(doc)
        if tok.eos is not None:
            ids.append(tok.eos)
    return ids, sum(len(d.encode("utf-8")) for d in chunk), len(chunk)


def prepare(inputs: list[str], out: Path, tokenizer: str = "bytes", val_fraction: float = 0.1,
            text_field: str = "text", workers: int = 0) -> dict[str, Any]:
    """Tokenize `inputs` into OUT/{train,val}.bin and OUT/meta.json; returns meta.json's content.
    The set is built in a hidden directory beside OUT and swapped in whole (atomic_write): an
    interrupted or failed prepare leaves the earlier set as it was, or no OUT at all."""
    sources = input_files(inputs)
    tok = tokenizers.load(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    workers = workers or min(8, len(os.sched_getaffinity(0)))
    out = Path(out)
    check_out(out)
    files.check_writable_dir(out, "--out", beside=True)
    meta: dict[str, Any] = {}

    def build(new: Path) -> None:
        new.mkdir()
        if out.is_dir():  # a shared data directory keeps its permissions
            os.chmod(new, out.stat().st_mode & 0o7777)
        meta.update(_tokenize(sources, tok, tokenizer, dtype, new, out, text_field, workers,
                              val_fraction))
        meta.update(vocab_size=tok.vocab_size, dtype=np.dtype(dtype).name, tokenizer=tok.spec(),
                    eos=tok.eos, sources=[str(s) for s in sources])
        _write(out, (new / "meta.json").write_text, json.dumps(meta, indent=1) + "\n")

    atomic_write.write_atomic(out, build, f"writing the token files in '{out}'", "--out")
    return meta


def check_out(out: Path) -> None:
    """--out can take a data set: a new directory, an empty one, or an earlier data set.
    Re-preparing replaces the whole directory, so one holding anything else is refused rather
    than deleted; so are the current directory (and those above it), a mount point, which
    cannot be renamed, and a place inside another command's output (a run's checkpoints/)."""
    from dtlab import owned

    owned.check_not_nested(out, "--out")
    target, here = out.resolve(), Path.cwd().resolve()
    below = f"choose a directory below it, e.g. --out {out / 'tokens'}"
    if target == here or target in here.parents:
        raise DataError(f"--out '{out}' is the current directory or holds it, and preparing "
                        f"replaces the whole directory; fix: {below}")
    if os.path.ismount(target):
        raise DataError(f"--out '{out}' is a mount point, which cannot be replaced whole; "
                        f"fix: {below}")
    if target.is_dir():
        others = sorted(p.name for p in target.iterdir() if p.name not in DATA_SET_FILES)
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3
                                             else "")
            raise DataError(f"--out '{out}' holds files that are not a token data set ({shown}),"
                            " and preparing replaces the whole directory; fix: choose another "
                            f"--out, e.g. {out / 'tokens'}, or move those files out of it")
        theirs = [n for n in ("train.bin", "val.bin") if (target / n).exists()
                  and not _prepared(target, n)]
        theirs += ["meta.json"] if (target / "meta.json").exists() and \
            not _meta_of_prepare(target) else []
        if theirs:
            made = "dtlab prepare did not write" if theirs == ["meta.json"] else \
                "no meta.json of dtlab prepare describes (token files made elsewhere)"
            raise DataError(f"--out '{out}' holds {' and '.join(theirs)}, which {made}, and "
                            "preparing replaces the whole directory; fix: choose another --out, "
                            f"e.g. {out / 'tokens'}, or move them out of it")


def _meta_of_prepare(folder: Path) -> bool:
    """Whether folder/meta.json is one dtlab prepare wrote (its files and tokenizer recorded)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return isinstance(meta.get("files"), dict) and "tokenizer" in meta
    except (OSError, ValueError, AttributeError):
        return False


def _prepared(folder: Path, name: str) -> bool:
    """Whether meta.json (dtlab prepare's) describes `name` as it is: its size recorded."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        entry = meta["files"][name]
        return int(entry["bytes"]) == (folder / name).stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _tokenize(sources: list[Path | str], tok: tokenizers.Tokenizer, tokenizer: str, dtype: type,
              new: Path, out: Path, text_field: str, workers: int,
              val_fraction: float) -> dict[str, Any]:
    """Encode every document into one stream in `new` (the draft of `out`), then split it into
    train.bin and val.bin there; returns their counts, sizes and checksums."""
    local = [s for s in sources if isinstance(s, Path)]
    size = sum(s.stat().st_size for s in local)
    stream = new / ".tokens.tmp"
    bar = _bar(size if len(local) == len(sources) else None)
    total = docs = 0
    try:
        with open(stream, "wb") as f:
            pool = None
            if workers > 1 and (size >= POOL_FROM_BYTES or len(local) < len(sources)):
                pool = _start_pool(workers, tokenizer)
                encoded = pool.imap(_encode_in_worker, _chunks(sources, text_field))
            else:
                encoded = (_encode(tok, chunk) for chunk in _chunks(sources, text_field))
            try:
                for ids, n_bytes, n_docs in encoded:
                    _write(out, f.write, np.asarray(ids, dtype=dtype).tobytes())
                    total += len(ids)
                    docs += n_docs
                    if bar is not None:
                        bar.update(n_bytes)
                _write(out, f.flush)  # so that closing the file has nothing left to write
            finally:
                if pool is not None:
                    _stop_pool(pool)
        meta = _write(out, _split, stream, new, dtype, total, val_fraction)
    finally:
        stream.unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return {**meta, "documents": docs}


def _start_pool(workers: int, tokenizer: str) -> Any:
    """The encoding workers, started with Ctrl-C ignored: Ctrl-C reaches the whole process group,
    and a worker that dies of it prints a traceback; this process stops them instead."""
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the spawned workers
    try:
        return get_context("spawn").Pool(workers, _start_worker, (tokenizer,))
    finally:
        signal.signal(signal.SIGINT, ignored)


def _stop_pool(pool: Any, wait_s: float = 3.0) -> None:
    """pool.terminate(), without waiting for ever: when a signal killed a worker while a chunk was
    being sent to it, the pool's sending thread stays blocked on that chunk and terminate() would
    wait for it (a hang). The workers are daemon processes, ended at exit in any case."""
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(wait_s)


def _write(out: Path, write: Any, *args: Any) -> Any:
    """write(*args); a refused write (a full disk, a file-size limit) is one line, as a run's."""
    try:
        return write(*args)
    except OSError as e:
        raise DtlabError(files.describe(e, f"writing the token files in '{out}'", "--out")) from None


def _split(stream: Path, new: Path, dtype: type, total: int,
           val_fraction: float) -> dict[str, Any]:
    val = math.ceil(total * val_fraction)
    if total == 0 or val == 0 or val == total:
        raise DataError(f"the inputs give {total} tokens, too few for a train and a validation "
                        f"split at --val-fraction {val_fraction}; fix: add text")
    tokens = np.memmap(stream, dtype=dtype, mode="r")
    written = {}
    for name, part in (("train", tokens[: total - val]), ("val", tokens[total - val :])):
        path = new / f"{name}.bin"
        part.tofile(path)
        written[path.name] = {"bytes": path.stat().st_size, "sha256": files.file_sha256(path)}
    del tokens  # the memory map, before the stream is deleted
    return {"tokens": {"train": total - val, "val": val}, "files": written}


def _bar(total_bytes: int | None) -> Any:
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)
