"""A process started by a dtlab launcher dies with it, whatever ends the launcher (an OOM kill,
`kill -9` of its process group, a scheduler's hard kill), and writes nothing after it is gone.

The launchers are torch elastic's agent inside `dtlab train` / `dtlab comm` (its ranks), and
`dtlab compare` and `dtlab sweep` (their `dtlab train` runs). A launcher names itself (pid and start
time) in its children's environment; a child started that way then
- asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG). The kernel sends it
  when the parent *thread* that started the child ends: every dtlab launcher starts its children
  from its main thread, which lives as long as the process;
- watches the launcher from a thread, every POLL_S, for what that signal misses: a child started
  through another program (a wrapper, `sh -c`), or a launcher that died before the child asked.
SIGKILL, not SIGTERM: on SIGTERM a run saves a checkpoint, written after its launcher is gone. A
checkpoint cut short stays a `.tmp-` directory, which no resume reads (dtlab/run/checkpoint.py).
Processes started otherwise (srun tasks, torchrun, by hand) have no launcher named: nothing changes.

Only the standard library: a worker runs this before it imports torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress

from dtlab.process.environment import variables_set

PID_VAR, START_VAR = "DTLAB_LAUNCHER_PID", "DTLAB_LAUNCHER_START"
POLL_S = 0.5  # how long a child may outlive its launcher when the kernel's signal missed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), None when it is gone or a zombie: with the
    pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields[19]


def launcher_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) naming this process as the children's
    launcher (on Linux; elsewhere `env` unchanged)."""
    out = dict(os.environ if env is None else env)
    start = start_time(os.getpid())
    if start is not None:
        out[PID_VAR], out[START_VAR] = str(os.getpid()), start
    return out


@contextmanager
def launching() -> Iterator[None]:
    """While torch elastic starts workers (from this process's environment): this process is
    their launcher. The variables are restored afterwards, so that nothing else inherits them."""
    with variables_set(launcher_env()):
        yield


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel for SIGKILL when this process's parent dies (Linux; elsewhere nothing).
    `parent`: the pid it was started by; gone before the kernel was asked, SIGKILL now."""
    with suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """In a child of a dtlab launcher: stop (SIGKILL) as soon as the launcher is gone. The
    variables are removed here: this process's own children are guarded by it, if it launches."""
    pid_text, start = os.environ.pop(PID_VAR, ""), os.environ.pop(START_VAR, "")
    if not pid_text.isdigit() or not start or not sys.platform.startswith("linux"):
        return
    launcher = int(pid_text)
    is_parent = os.getppid() == launcher
    die_with_parent()  # the watch below covers a libc without prctl
    if not _alive(launcher, start, is_parent):  # it died before the kernel was asked
        _orphaned(launcher)
    threading.Thread(target=_watch, args=(launcher, start, is_parent), daemon=True,
                     name="dtlab-launcher-watch").start()


def _alive(launcher: int, start: str, is_parent: bool) -> bool:
    # A child re-parented (to init or a subreaper) has lost its launcher even if the pid lives on.
    return (not is_parent or os.getppid() == launcher) and start_time(launcher) == start


def _watch(launcher: int, start: str, is_parent: bool) -> None:
    while _alive(launcher, start, is_parent):
        time.sleep(POLL_S)
    _orphaned(launcher)


def _orphaned(launcher: int) -> None:
    """One line (from rank 0 only; the terminal may be gone with the launcher), then SIGKILL:
    no handler, no cleanup, no file written after this."""
    if os.environ.get("RANK", "0") == "0":
        with suppress(OSError):
            os.write(2, f"dtlab: stopped: the dtlab process that started this one (pid "
                        f"{launcher}) is gone\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
