"""What the messages of a stopped or failed run say about its run directory: which checkpoint a
rerun continues from, and how to start over; each true when followed."""

from __future__ import annotations

import os
from pathlib import Path

from dtlab.rundir.checkpoints import checkpoint_root, complete_checkpoints

RESUME_HINT = "resume=auto continues from it"
# A parent that re-runs `dtlab train` its own way (compare starts over) says what a rerun does.
RESUME_HINT_ENV = "DTLAB_RESUME_HINT"


def resume_hint(hint: str = RESUME_HINT) -> str:
    """What continues a stopped run, unless the parent that started it says otherwise."""
    return os.environ.get(RESUME_HINT_ENV) or hint


def intact_note(run_dir: Path) -> str:
    """Which checkpoint a rerun continues from, for the messages of a failed run."""
    found = complete_checkpoints(run_dir, warn=False)
    if not found:
        return "no checkpoint was written yet (train.checkpoint_every sets how often)"
    return f"step {found[-1][0]} is intact ({resume_hint()})"


def earlier_outputs(run_dir: Path) -> list[str]:
    """What an earlier run left in run_dir: its checkpoints, metrics and summary."""
    found = []
    complete = complete_checkpoints(run_dir, warn=False)
    root = checkpoint_root(run_dir)
    if complete:
        found.append(f"checkpoints up to step {complete[-1][0]}")
    elif root.is_dir() and any(root.iterdir()):
        found.append("an incomplete checkpoint")
    found += [name for name in ("metrics.jsonl", "summary.json") if (Path(run_dir) / name).is_file()]
    return found


def start_over(run_dir: Path) -> str:
    """How to start over in run_dir, true when followed: resume=none, with run.overwrite=true
    where an earlier run's files are in the way."""
    if earlier_outputs(run_dir):
        return ("start over with resume=none run.overwrite=true (deleting the earlier run in run.dir), "
                "or in another run.dir")
    return "start over with resume=none"
