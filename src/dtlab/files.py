"""What to say when the file system refuses a write: one line naming the path, the cause and the
fix. Used for the run directory (checked before any rank trains), the metrics, checkpoints, the
data directory and `dtlab export`.

Before training these are bad input (DtlabError, exit 2); once training has begun they are
RunErrors (exit 1): nothing the user typed was wrong, but the run cannot go on.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import resource
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dtlab.errors import DtlabError

MB = 1e6

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file-size limit (ulimit -f)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "part of the path is a file, not a directory",
    errno.EEXIST: "a file of that name is in the way",
    errno.EISDIR: "it is a directory",
}
FULL = (errno.ENOSPC, errno.EDQUOT)
# Failures of the file system (not of the network or the data): a write that cannot happen.
WRITE_FAILURES = (*FULL, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                  errno.EISDIR, errno.EEXIST)


def cause(error: OSError) -> str:
    return _CAUSES.get(error.errno or 0, error.strerror or str(error))


def fix(error: OSError, key: str) -> str:
    """What to do about `error`, for the setting `key` that chose the path (e.g. run.dir)."""
    code = error.errno
    if code in FULL:
        return f"free space on that disk, or set {key} to a path on another one"
    if code == errno.EFBIG:
        return f"raise the limit (ulimit -f unlimited), or set {key} elsewhere"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"make it writable, or set {key} to a writable directory"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"set {key} to a directory path, or move the file out of the way"
    return f"check the file system, or set {key} to another directory"


def describe(error: OSError, doing: str, key: str) -> str:
    """'<cause> while <doing>; fix: <fix>' (doing names the path)."""
    return f"{cause(error)} while {doing}; fix: {fix(error, key)}"


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError behind `error`: itself, one it was raised from or during, or one named in its
    text the way Rust libraries (safetensors) report it, "(os error 28)"."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        named = re.search(r"\(os error (\d+)\)", str(error))
        if named:
            code = int(named.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def not_a_directory(path: Path, key: str, fix: str | None = None) -> str | None:
    """Why `path` cannot be a directory (it, or a parent, is a file), or None."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if p.is_dir():
                return None
            where = "is a file" if p == path else f"is inside '{p}', which is a file"
            fix = fix or f"set {key} to a directory path"
            return f"{key} '{path}' {where}, not a directory; fix: {fix}, or move the file out of the way"
    return None


def check_writable_dir(path: Path, key: str, beside: bool = False) -> None:
    """`path` is, or can be created as, a directory files can be written into (DtlabError if
    not); beside: files can be written next to it (where a whole-or-absent replacement of the
    directory is drafted). Nothing is created: a run refused later for another reason leaves
    no directory."""
    path = Path(path)
    problem = not_a_directory(path, key)
    if problem:
        raise DtlabError(problem)
    where = "beside" if beside else "in"
    candidates = (*path.parents, Path.cwd()) if beside else (path, *path.parents, Path.cwd())
    existing = next(p for p in candidates if p.exists())
    try:
        # Permission bits do not tell (root ignores them; a read-only mount does not): write.
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".dtlab-write-test-") as probe:
            probe.write(b"x")
            probe.flush()
    except OSError as e:
        raise DtlabError(describe(e, f"creating a file {where} {key} '{path}'", key)) from None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); {} where it cannot be read."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return info


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def file_size_limit() -> int | None:
    """The soft RLIMIT_FSIZE in bytes, None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path`."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def close_quietly(f: object) -> None:
    """Close a file whose buffered data may not fit on the disk any more (once: a failed flush
    would otherwise be retried, and reported, when the object is collected)."""
    with contextlib.suppress(OSError):
        f.close()  # type: ignore[attr-defined]


def replace_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` to a file (or a directory it makes) beside `path`, then rename it: the file
    is written whole or not at all (an earlier one stays until then; a directory replaces a
    missing or empty one). On failure the temporary file or directory is removed and the error
    raised as it came."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise


def write_whole(path: Path, write: Callable[[Path], object], doing: str, key: str,
                error: type[DtlabError] = DtlabError) -> None:
    """replace_whole(path, write); a refused write is one `error` naming the cause."""
    try:
        replace_whole(path, write)
    except Exception as e:
        os_error = os_error_in(e)
        if os_error is None:
            raise
        raise error(describe(os_error, doing, key)) from None


def write_text(path: Path, text: str, key: str) -> None:
    """A small file of the run, written whole or not at all (before training: DtlabError)."""
    write_whole(path, lambda tmp: tmp.write_text(text), f"writing '{path}'", key)


def file_sha256(path: Path) -> str:
    """The file's sha256, read in 16 MB pieces (a signal is handled between them)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            digest.update(piece)
    return digest.hexdigest()


def is_dtlab_report(path: Path) -> bool:
    """Whether `path` is an HTML report that `dtlab report` wrote (read from its first bytes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return report_head(head)


def report_head(head: bytes) -> bool:
    return head.lower().startswith(b"<!doctype html>") and b"<title>dtlab " in head
