"""The first and the last thing a dtlab process does about stop signals (`python -m dtlab`, the
`dtlab` command, a worker's `python -m dtlab.train` or `python -m dtlab.comm.bench`).

Until dtlab/process/interrupt.py takes over, a stop signal ends the process at once, and rank 0
says so. A process still importing torch has nothing to clean up, and Python's KeyboardInterrupt
would print a traceback from whatever import it interrupted. A process started by a dtlab
launcher also dies with it from here on (dtlab/process/launcher_guard.py).

Once the command has returned its exit code and said what it had to (`finishing`), a signal
(Ctrl-C pressed again, while the interpreter tears down) ends the process at once too, quietly
and with that code: a stopped command's one line is out, a finished command's result stands.
Python's own KeyboardInterrupt there would print "Exception ignored in atexit callback" and a
traceback.

Only the standard library is imported, to keep the window before this short."""

from __future__ import annotations

import atexit
import os
import signal
import sys
from contextlib import suppress

from dtlab.process.launcher_guard import die_with_launcher

TYPE_CHECKING = False  # not `typing`'s: its import would widen the window before the handlers
if TYPE_CHECKING:
    from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

_finished: list[int] = []  # the exit code the command returned, once it has


def leave_now(signum: int, frame: object = None) -> NoReturn:
    if _finished:  # the command's outcome stands; only the interpreter's teardown is cut short
        with suppress(Exception):  # what the command printed is not lost (a pipe buffers it)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(_finished[0])
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"dtlab: interrupted by {signal.Signals(signum).name} while starting\n"
                 .encode())
    os._exit(128 + signum)


def exit_on_signals() -> None:
    """Stop signals end the process at once; so does the end of the launcher that started it."""
    for s in SIGNALS:
        signal.signal(s, leave_now)
    atexit.register(_last_steps)  # before any library registers its own: runs after them all
    die_with_launcher()


def _last_steps() -> None:
    """After the atexit callbacks (a Ctrl-C there still ends them at once), only the
    interpreter's teardown is left, which ends by restoring the default action of the signals
    it handles: a late Ctrl-C would kill the process without its exit code. Ignored, nothing
    cuts it short."""
    if _finished:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def finishing(code: int) -> None:
    """The command returned `code` and said what it had to: from now on a stop signal, in
    whichever handler catches it, ends the process at once (`leave_now`)."""
    _finished[:] = [code]


def finished() -> bool:
    return bool(_finished)


def finishing_forgotten() -> None:
    """A command starts (again: commands run inside a test process one after another)."""
    _finished.clear()
