"""The first thing a dtlab process does (`python -m dtlab`, a worker's `python -m dtlab.train` or
`python -m dtlab.comm.bench`): until dtlab/process/interrupt.py takes over, a stop signal ends the process
at once, and rank 0 says so. A process still importing torch has nothing to clean up, and Python's
KeyboardInterrupt would print a traceback from whatever import it interrupted. A process started
by a dtlab launcher also dies with it from here on (dtlab/process/launcher_guard.py). Only the standard
library is imported, to keep the window before this short."""

import os
import signal

from dtlab.process.launcher_guard import die_with_launcher

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _leave_now(signum: int, frame: object) -> None:
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"dtlab: interrupted by {signal.Signals(signum).name} while starting\n".encode())
    os._exit(128 + signum)


def exit_on_signals() -> None:
    """Stop signals end the process at once; so does the end of the launcher that started it."""
    for s in SIGNALS:
        signal.signal(s, _leave_now)
    die_with_launcher()
