"""Writes that are whole or absent: a file or directory is written as a draft beside its
target (same file system), flushed to disk, then renamed over it, so that a reader, a crash or a
Ctrl-C finds the old version or the whole new one, never a mix. `dtlab prepare` (the token
directory) and `dtlab export` (a file, or a Hugging Face directory) write this way.

Drafts and set-aside copies live beside their target under hidden names that carry the writing
process's pid (.NAME.dtlab-new-PID): two writers never share one, and the next write can tell
what a dead process left behind (clean_leftovers) from what a live one is still writing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from dtlab.errors import DtlabError
from dtlab.files import describe, os_error_in

_BESIDE = re.compile(r"\.(?P<name>.+)\.dtlab-(?P<kind>new|old|trash)-(?P<pid>\d+)")
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def beside(path: Path, kind: str) -> Path:
    """This process's hidden name next to `path`: kind 'new' (a draft), 'old' (the version
    being replaced, set aside) or 'trash' (being deleted)."""
    return path.with_name(f".{path.name}.dtlab-{kind}-{os.getpid()}")


def _running(pid: int) -> bool:
    if pid == os.getpid():  # an earlier process with this pid: gone
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(path: Path) -> None:
    """Delete a file or a directory tree, quietly (cleaning up must not hide the real error)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def clean_leftovers(path: Path) -> None:
    """Tidy what an interrupted replacement of `path` by a process no longer running left
    beside it: drafts and trash are deleted; a set-aside old version returns when nothing took
    its place (the process died between the two renames of swap_in), else it is deleted."""
    path = Path(path)
    try:
        found = [(m, p) for p in path.parent.iterdir()
                 if (m := _BESIDE.fullmatch(p.name)) and m["name"] == path.name]
    except OSError:
        return
    for m, p in sorted(found, key=lambda f: f[0]["kind"] != "old"):
        if _running(int(m["pid"])):
            continue
        if m["kind"] == "old" and not os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.rename(p, path)
                continue
        remove(p)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Stop signals wait until the block is done (a Ctrl-C lands after it, not inside)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def swap_in(new: Path, path: Path) -> None:
    """Put `new` (beside `path`) at `path`. A file replaces a file in one rename; a directory
    replaces a directory in two (the old one set aside, the new one renamed in), with signals
    held in between: `path` is the old version or the whole new one, never a mix, and a crash
    between the renames leaves the old one set aside, which clean_leftovers restores."""
    old, trash = beside(path, "old"), None
    try:
        with signals_held():  # a signal that came meanwhile is raised on leaving the block
            if os.path.isdir(path) and not os.path.islink(path) and os.path.isdir(new):
                os.rename(path, old)
                try:
                    os.rename(new, path)
                except BaseException:
                    os.rename(old, path)
                    raise
                trash = beside(path, "trash")
                os.rename(old, trash)
            else:
                os.replace(new, path)
            sync(path.parent)
    finally:
        if trash is not None:
            remove(trash)


def sync(path: Path) -> None:
    """fsync a file, or a directory and everything under it, so that a rename publishes data
    that is on the disk (a directory's own fsync is skipped where the file system refuses it)."""
    path = Path(path)
    if not path.is_dir():
        _fsync(path, directory=False)
        return
    for root, _, names in os.walk(path):
        for name in names:
            _fsync(Path(root) / name, directory=False)
        _fsync(Path(root), directory=True)


def _fsync(path: Path, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not directory or e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def make_parents(path: Path) -> list[Path]:
    """Create the missing directories above `path`; returns those made, outermost first."""
    missing = [p for p in reversed(Path(path).parents) if not p.exists()]
    for p in missing:
        p.mkdir()
    return missing


def remove_empty(dirs: list[Path]) -> None:
    """Remove the directories (from make_parents) that are still empty, innermost first."""
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


def write_atomic(path: Path, write: Callable[[Path], object], doing: str, key: str,
                 error: type[DtlabError] = DtlabError) -> Path:
    """`write(draft)` to a file or a directory (which `write` makes) beside `path`, fsync it,
    then swap_in: `path` holds its old version or the whole new one, never part of either. A
    symlink is followed (the file it names is replaced). Missing parent directories are made,
    and removed again if the write fails; so is the draft. A refused write (OSError) is one
    `error` line naming the cause and the fix for `key`; other errors pass through. Returns
    the path written."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    clean_leftovers(path)
    draft = beside(path, "new")
    made: list[Path] = []
    try:
        made = make_parents(path)
        write(draft)
        sync(draft)
        swap_in(draft, path)
    except BaseException as e:
        remove(draft)
        remove_empty(made)
        os_error = None if isinstance(e, DtlabError) else os_error_in(e)
        if os_error is None or not isinstance(e, Exception):
            raise
        raise error(describe(os_error, doing, key)) from None
    return path


def check_replaceable(path: Path, what: str, earlier: Callable[[bytes], bool], fix: str,
                      flag: str = "") -> None:
    """Refuse to replace a file that is not an earlier output of ours: `earlier(head)` tests its
    first 512 bytes; an empty file holds nothing to lose. The line names `what` it should have
    been and the `fix` (another name), or moving the file away."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        head = b""
    if not earlier(head):
        raise DtlabError(f"{flag + ' ' if flag else ''}'{path}' exists and is not {what}: writing "
                         f"there would replace it; fix: {fix}, or move that file away first")
