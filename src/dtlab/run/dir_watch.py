"""A run directory deleted or replaced while its run trains (docs/reliability.md#one-run-per-directory):
rank 0 watches it, and every rank stops at the next step boundary; nothing recreates it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtlab.errors import PeerError, RunError

GONE = 1 << 10  # in the ranks' stop agreement: above every signal number


class RunDirGone(RunError):
    """The run directory was deleted or replaced while the run trained."""


class PeerSawRunDirGone(PeerError):
    exit_code = 1


class DirectoryWatch:
    """The run directory as it was when the run began (its device and inode). Rank 0 watches
    (it writes the run's files); the ranks learn of it in their stop agreement."""

    def __init__(self, run_dir: Path) -> None:
        self.path, self.ident = Path(run_dir), None
        self.lost = False

    def start(self) -> None:
        self.ident = ident(self.path)

    def problem(self) -> str | None:
        if self.ident is None:
            return None
        now = ident(self.path)
        if now == self.ident:
            return None
        return "was deleted" if now is None else "was replaced by another directory"

    def intact(self) -> bool:
        """Whether the run may still write there (a failure's records, the stop's line)."""
        return not self.lost and self.problem() is None

    def stop(self, ctx: Any, step: int, what: str | None) -> None:
        """Raise on every rank (RunDirGone on rank 0, which says it)."""
        self.lost = True
        if not ctx.is_main:
            raise PeerSawRunDirGone("rank 0 found the run directory gone")
        raise RunDirGone(self.line(step, what))

    def require(self, step: int) -> None:
        """Rank 0, right before it writes into the run directory: RunDirGone if it is gone."""
        what = self.problem()
        if what:
            self.lost = True
            raise RunDirGone(self.line(step, what))

    def line(self, step: int, what: str | None) -> str:
        return (f"run.dir '{self.path}' {what or 'was deleted or replaced'} during the run; it "
                f"stopped after step {step} and wrote nothing more; fix: leave run.dir in place "
                "while a run uses it (to start over, run.overwrite=true or another run.dir)")


def ident(path: Path) -> tuple[int, int] | None:
    """A directory's device and inode, None when it is gone: another one put at its path has
    other ones."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def check_directory(ctx: Any, watch: DirectoryWatch | None, step: int) -> None:
    """Collective: stop every rank when rank 0 found the run directory gone."""
    if watch is None:
        return
    what = watch.problem()
    if ctx.agree_stop(GONE if what else 0) >= GONE:
        watch.stop(ctx, step, what)
