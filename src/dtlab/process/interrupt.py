"""Stopping on a signal, in every dtlab process: one line, exit code 128 + the signal number
(130 for SIGINT, 143 for SIGTERM), no traceback, nothing left running.

- SIGINT (Ctrl-C), SIGTERM (kill, SLURM preemption and time limits), SIGHUP, SIGUSR1, SIGUSR2
  stop a run. SIGTERM and the configured checkpoint signal (`run.checkpoint_signal`, e.g. USR1
  for `sbatch --signal=USR1@90`) first save a checkpoint when `train.checkpoint_every` is set.
- Inside the training loop a signal only sets a flag: the signal reaches the ranks at different
  times, so at each step boundary they agree (one all-reduce of an int, MAX over ranks) and all
  stop after the same step. A stop that does not reach a step boundary within a deadline (a hung
  step) is forced; so is a second Ctrl-C.
- Anywhere else (start-up, evaluation after the last step, a parent waiting for its children) a
  signal raises `Interrupted` at once; a parent first passes it on to its children's process groups.

Only the standard library (and early_exit.py, likewise) is imported here: a worker installs these
handlers before it imports torch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from dtlab.process import early_exit

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
INTERRUPT_CODES = frozenset(128 + s for s in STOP_SIGNALS) | frozenset(-s for s in STOP_SIGNALS)


def name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(BaseException):  # like KeyboardInterrupt: `except Exception` lets it through
    """The process was asked to stop by signal `signum`. `where` completes the one line;
    quiet: another process explains the stop (a peer failed, the child printed it)."""

    def __init__(self, signum: int, where: str = "", quiet: bool = False) -> None:
        super().__init__(signum)
        self.signum, self.where, self.quiet = signum, where, quiet
        _state.stopping = True  # the process is on its way out: later signals change nothing

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        return f"dtlab: interrupted by {name(self.signum)}{self.where}"


class _State:
    def __init__(self) -> None:
        self.signum: int | None = None  # the signal that asked this process to stop
        self.deferred = False  # in the training loop: stop at the next step boundary
        self.deadline_s = 0.0  # how long a deferred stop may wait for that boundary
        self.collateral = False  # a collective failed: peers are gone, the stop is theirs
        self.forward = False  # a parent: pass signals on to the children's process groups
        self.forced = False  # the deadline passed: stop now
        self.stopping = False  # an Interrupted was raised: cleaning up
        self.busy = False  # evaluating or saving: progress, not a hang
        self.timer: threading.Timer | None = None


_state = _State()


def _handler(signum: int, frame: Any) -> None:
    if early_exit.finished():  # the command returned its code: nothing is left to stop
        early_exit.leave_now(signum)
    if _state.stopping and not _state.forward:
        return
    repeat = _state.signum is not None
    # SIGTERM after a Ctrl-C (or the checkpoint signal) still asks for the checkpoint: keep the
    # larger number, which is what the ranks agree on too.
    _state.signum = max(signum, _state.signum or 0)
    if _state.forward:
        kids = children(os.getpid())
        for pid in kids:
            _signal_group(pid, signum)
        if kids:
            return
    if _state.deferred and not _state.forced and not (repeat and signum == signal.SIGINT):
        if not repeat:  # a step that never ends (a hang) is cut short
            _state.timer = threading.Timer(_state.deadline_s, _force, (_state,))
            _state.timer.daemon = True
            _state.timer.start()
        return
    raise Interrupted(_state.signum, quiet=_state.collateral)


def _force(state: _State) -> None:
    """The deadline of a deferred stop passed: a real signal to the main thread, which also
    ends a blocking sleep there (a Python-level interrupt would not)."""
    if state is not _state or not state.deferred:
        return
    if state.busy:  # an evaluation or a checkpoint save: look again later
        state.timer = threading.Timer(state.deadline_s, _force, (state,))
        state.timer.daemon = True
        state.timer.start()
        return
    state.forced = True
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def install(carry: bool = False) -> None:
    """Handle the stop signals in this process from now on (forgetting any earlier request;
    `carry`: but a lost() one)."""
    global _state
    before, _state = _state, _State()
    if carry and before.stopping:
        _state.signum, _state.stopping = before.signum, True
    early_exit.finishing_forgotten()
    for s in STOP_SIGNALS:
        signal.signal(s, _handler)


@contextmanager
def handling() -> Iterator[None]:
    """install() for a while, then the handlers from before (a run inside a test process).
    Inside another handling() (`dtlab train` runs 1 rank in its own process), a stop lost()
    before is kept: the scope inside would otherwise start deaf to it."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    install(carry=before[signal.SIGINT] is _handler)
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable(sys.unraisablehook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _unraisable(hook: Any) -> Any:
    """sys.unraisablehook without the "Exception ignored in" traceback of an Interrupted that
    landed in a __del__ or a weakref callback, where Python drops it: lost() stops anyway."""

    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, Interrupted):
            hook(info)

    return unraisable


def requested() -> int | None:
    """The stop signal received so far, if any."""
    return _state.signum


def lost() -> Interrupted | None:
    """The stop this process raised an Interrupted for, if it still goes on: the exception never
    reached the code that stops, because a handler's exception can land where a library drops
    it (C code that checks for signals and clears the error, a __del__, an import that catches
    what it runs into). Measured: 2 of 40 Ctrl-Cs during a 1-rank run's set-up, which then
    trained to the end deaf to more Ctrl-Cs, or failed in a half-done import. Raised again at
    the training loop (`deferred`), reported by the CLI (dtlab/cli/main.py)."""
    if _state.stopping and _state.signum is not None:
        return Interrupted(_state.signum, quiet=_state.collateral)
    return None


def mark_collateral() -> None:
    """A collective failed: a stop from now on is quiet (the rank that failed says why)."""
    _state.collateral = True


@contextmanager
def deferred(deadline_s: float) -> Iterator[None]:
    """Signals only set the flag (the ranks agree on it: run/stop.py's StopVote); a stop not
    taken within deadline_s (not counting `busy()` time) is forced."""
    stop = lost()
    if stop is not None:  # the loop would otherwise run, every later signal ignored
        raise stop
    _state.deferred, _state.deadline_s = True, deadline_s
    try:
        yield
    finally:
        _state.deferred = False
        stop_deadline()


@contextmanager
def busy() -> Iterator[None]:
    """An evaluation or a checkpoint save: slow, but not a hang; the deadline waits for it."""
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = False


def set_deadline(deadline_s: float) -> None:
    _state.deadline_s = deadline_s


def stop_deadline() -> None:
    """The step boundary was reached: the stop proceeds (a checkpoint may take a while)."""
    if _state.timer is not None:
        _state.timer.cancel()


@contextmanager
def forwarding() -> Iterator[None]:
    """While a child runs: a signal is passed on to the process groups of this process's
    children (each started in a process group of its own), which stop and report; `requested()` says
    afterwards that the parent should stop too."""
    _state.forward = True
    try:
        yield
    finally:
        _state.forward = False


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc; empty elsewhere)."""
    return [p for p, (ppid, _pgid, st) in _processes().items() if ppid == pid and st != "Z"]


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process."""
    out = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def live_groups(pgids: set[int]) -> list[int]:
    """The live (not zombie) processes whose process group is one of `pgids`."""
    return sorted(p for p, (_, g, st) in _processes().items() if g in pgids and st != "Z")


def descendant_groups(pid: int) -> set[int]:
    """The process groups of `pid`'s descendants (torch elastic starts each worker in its own)."""
    procs, groups, todo = _processes(), set(), [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, pgid, _) in procs.items():
            if ppid == parent:
                groups.add(pgid)
                todo.append(p)
    return groups


def _signal_group(pgid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop_groups(pgids: set[int], signum: int | None, grace_s: float) -> None:
    """Send signum (if any) to the groups, wait up to grace_s for them to end, SIGKILL the rest."""
    for g in pgids if signum else ():
        _signal_group(g, signum)
    end = time.monotonic() + grace_s
    while live_groups(pgids) and time.monotonic() < end:
        time.sleep(0.05)
    for g in pgids:
        if live_groups({g}):
            _signal_group(g, signal.SIGKILL)


def report(e: Interrupted, main: bool = True) -> int:
    """Print the one line (unless quiet or not the main process); the exit code."""
    if main and not e.quiet:
        print(e.line(), file=sys.stderr, flush=True)
    return e.exit_code

