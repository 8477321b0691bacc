"""Where a training run stops when it is asked to (dtlab/interrupt.py): at a step boundary all
ranks agree on, after a checkpoint when the signal asks for one; the one line that says where,
and `run.json` in the run directory (what collect, the report and sweeps read)."""

from __future__ import annotations

import signal
from pathlib import Path

from dtlab import checkpoint, interrupt, state
from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.interrupt import Interrupted
from dtlab.run_state import RunState, Training
from dtlab.sweeps.record import now, read_record, update_record

STOP_DEADLINE_S = 3.0  # the least time a stop waits for the step boundary


def checkpoint_signals(cfg: Config) -> set[int]:
    """The signals after which a run saves a checkpoint before it stops."""
    named = cfg.run.checkpoint_signal
    return {signal.SIGTERM, *([signal.Signals[f"SIG{named}"]] if named else [])}


def stop_at_boundary(cfg: Config, ctx: DistContext, tr: Training, run: RunState, run_dir: Path,
                     saved: bool) -> None:
    """At a step boundary: when any rank was asked to stop, all stop here, after a checkpoint
    when the signal asks for one and checkpoints are on."""
    signum = ctx.agree_stop(interrupt.requested() or 0)
    if not signum:
        return
    interrupt.stop_deadline()
    if signum in checkpoint_signals(cfg) and cfg.train.checkpoint_every and not saved:
        state.save(cfg, ctx, tr, run)
        saved = True
    if saved:
        where = (f" at step {run.step}; saved checkpoint step {run.step}; resume=auto continues "
                 "from it")
    else:
        where = f" at step {run.step}{last_checkpoint(cfg, run_dir)}"
    raise Interrupted(signum, where)


def last_checkpoint(cfg: Config, run_dir: Path) -> str:
    found = checkpoint.complete_checkpoints(run_dir, warn=False)
    if found:
        return f"; last checkpoint step {found[-1][0]}; resume=auto continues from it"
    if cfg.train.checkpoint_every:
        return "; no checkpoint yet, a rerun starts over"
    return "; no checkpoint (train.checkpoint_every=0), a rerun starts over"


def record_stop(run_dir: Path, stopped: Interrupted | None) -> None:
    """run.json: `interrupted` with the line and exit code; `done` once a later run completes it."""
    if stopped is not None and run_dir.is_dir():
        update_record(run_dir, status="interrupted", returncode=stopped.exit_code,
                      reason=stopped.line().removeprefix("dtlab: "), finished_at=now())
    elif stopped is None and (read_record(run_dir) or {}).get("status") == "interrupted":
        update_record(run_dir, status="done", reason="", returncode=0, finished_at=now())
