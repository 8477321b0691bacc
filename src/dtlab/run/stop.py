"""Where a training run stops when it is asked to (dtlab/process/interrupt.py): at a step boundary all
ranks agree on, after a checkpoint when the signal asks for one; the one line that says where,
and `run.json` in the run directory (what collect, the report and sweeps read)."""

from __future__ import annotations

import signal
from pathlib import Path

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted
from dtlab.run import checkpoint, state
from dtlab.run.owner import GONE
from dtlab.run.run_state import RunState, Training
from dtlab.run.sweep_record import now, read_record, update_record
from dtlab.rundir.hints import resume_hint

STOP_DEADLINE_S = 3.0  # the least time a stop waits for the step boundary


def checkpoint_signals(cfg: Config) -> set[int]:
    """The signals after which a run saves a checkpoint before it stops."""
    named = cfg.run.checkpoint_signal
    return {signal.SIGTERM, *([signal.Signals[f"SIG{named}"]] if named else [])}


def stop_at_boundary(cfg: Config, ctx: DistContext, tr: Training, run: RunState, run_dir: Path,
                     saved: bool) -> None:
    """At a step boundary: when any rank was asked to stop, all stop here, after a checkpoint
    when the signal asks for one and checkpoints are on; when the run directory is gone, all
    stop with an error (the same agreement: one all-reduce)."""
    gone = run.watch.problem() if run.watch is not None else None
    signum = ctx.agree_stop(max(interrupt.requested() or 0, GONE if gone else 0))
    if signum >= GONE and run.watch is not None:
        run.watch.stop(ctx, run.step, gone)
    if not signum:
        return
    interrupt.stop_deadline()
    if signum in checkpoint_signals(cfg) and cfg.train.checkpoint_every and not saved:
        state.save(cfg, ctx, tr, run)
        saved = True
    if saved:
        where = f" at step {run.step}; saved checkpoint step {run.step}; {resume_hint()}"
    else:
        where = f" at step {run.step}{last_checkpoint(cfg, run_dir)}"
    raise Interrupted(signum, where)


def last_checkpoint(cfg: Config, run_dir: Path) -> str:
    found = checkpoint.complete_checkpoints(run_dir, warn=False)
    if found:
        return f"; last checkpoint step {found[-1][0]}; {resume_hint()}"
    if cfg.resume not in ("auto", "none"):
        rerun = f"a rerun resumes '{cfg.resume}' again"
    elif cfg.resume == "auto" or cfg.run.overwrite:
        rerun = "a rerun starts over"
    else:  # resume=none is refused beside this run's metrics
        rerun = "a rerun with run.overwrite=true starts over"
    if cfg.train.checkpoint_every:
        return f"; no checkpoint yet, {rerun}"
    return f"; no checkpoint (train.checkpoint_every=0), {rerun}"


def record_stop(run_dir: Path, stopped: Interrupted | None) -> None:
    """run.json: `interrupted` with the line and exit code; `done` once a later run completes it."""
    if stopped is not None and run_dir.is_dir():
        update_record(run_dir, status="interrupted", returncode=stopped.exit_code,
                      reason=stopped.line().removeprefix("dtlab: "), finished_at=now())
    elif stopped is None and (read_record(run_dir) or {}).get("status") == "interrupted":
        update_record(run_dir, status="done", reason="", returncode=0, finished_at=now())
