"""One run at a time in a run directory (docs/reliability.md#one-run-per-directory).

The process that starts a run holds an exclusive `flock` on the run directory itself from before
it reads the directory until it ends: `dtlab train`'s launcher on one node (its ranks inherit the
right through LOCK_VAR), or rank 0 where no dtlab launcher started the ranks (torchrun, srun, a
multi-node launch). A second `dtlab train` on the same directory is refused in one line naming
the holder. The kernel drops the lock with the process, however it ends (SIGKILL included), so
a killed run never leaves the directory locked.

The directory is created for the lock when missing, and removed again when the run leaves it
empty (a refused run leaves nothing behind).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from dtlab.errors import ConfigError
from dtlab.process.environment import variables_set
from dtlab.run.dir_watch import ident

LOCK_VAR = "DTLAB_RUN_DIR_LOCKED"  # the run directory this process's launcher holds


def _holder(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks (None where it cannot be told)."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" in fields and len(fields) > 5 and fields[5].endswith(f":{inode}"):
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


def _made(path: Path) -> list[tuple[Path, tuple[int, int] | None]]:
    """Create `path` and its missing parents; the directories created (with their device and
    inode: one put in its place later is not ours to remove), deepest first."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return [(p, ident(p)) for p in missing]


@contextlib.contextmanager
def held(run_dir: Path, flag: str = "run.dir", what: str = "run") -> Iterator[None]:
    """Hold the run directory's lock inside the block (ConfigError when another process does).
    Also the output directory of a compare or a sweep (`flag` "--out", `what` their name), for
    the whole command: a second one there would replace the running one's runs."""
    path = Path(run_dir)
    real = os.path.realpath(path)
    if what == "run" and os.environ.get(LOCK_VAR) == real:  # this rank's launcher holds it
        yield
        return
    try:
        made = _made(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # not a directory that can be made or opened: the path checks say why
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(path)
            who = f" (pid {pid})" if pid else ""
            raise ConfigError(f"{flag} '{run_dir}' is in use by another dtlab {what}{who}; fix: "
                              f"wait for it to end, or choose another {flag}") from None
        except OSError:  # a file system without flock (some network mounts): unguarded
            pass
        with variables_set({LOCK_VAR: real} if what == "run" else {}):
            yield
    finally:
        os.close(fd)
        for d, was in made:  # a run that wrote nothing leaves no directory
            with contextlib.suppress(OSError):
                if ident(d) == was:
                    d.rmdir()


def in_use(path: Path) -> bool:
    """Whether a process holds `path`'s lock now (a compare or sweep running its runs there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
