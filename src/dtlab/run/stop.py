"""Where a training run stops when it is asked to (dtlab/process/interrupt.py): at a step boundary all
ranks agree on, after a checkpoint when the signal asks for one; the one line that says where,
and `run.json` in the run directory (what collect, the report and sweeps read)."""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted
from dtlab.run import checkpoint, state
from dtlab.run.dir_watch import GONE
from dtlab.run.run_state import RunState, Training
from dtlab.run.sweep_record import is_record, now, read_record, update_record
from dtlab.rundir.hints import resume_hint

STOP_DEADLINE_S = 3.0  # the least time a stop waits for the step boundary


def checkpoint_signals(cfg: Config) -> set[int]:
    """The signals after which a run saves a checkpoint before it stops."""
    named = cfg.run.checkpoint_signal
    return {signal.SIGTERM, *([signal.Signals[f"SIG{named}"]] if named else [])}


VOTE_EVERY_S = 0.05  # how often the ranks vote, in step time (at least once a step)
MAX_VOTE_PERIOD = 16  # and at least every this many steps


class StopVote:
    """The ranks' agreement to stop: the largest stop code any rank holds (a signal, or GONE),
    by an all-reduce (MAX) of two ints overlapped with the steps that follow it. A vote is read
    where the next one is posted, so every rank sees the same result at the same boundary and
    stops after the same step. Votes are VOTE_EVERY_S of step time apart (every step for steps
    of 50 ms or more, at most MAX_VOTE_PERIOD steps apart); each carries its rank's proposal
    for the next period, and the largest is taken, so the ranks keep the same schedule. A stop
    is taken within two periods of the signal. The last step's vote is waited for at once.

    Why not a blocking all-reduce at every boundary: it made every rank wait there for the
    slowest one, a second barrier per step beside the gradients' all-reduce, and the call
    itself costs ~0.15 ms of CPU on this machine (docs/benchmarks.md, dtlab's loop overhead)."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.pending: tuple[dist.Work, torch.Tensor] | None = None
        self.period, self.countdown = 1, 0

    def due(self, last: bool) -> bool:
        """Whether this boundary votes (every rank gets the same answer); counts the boundary."""
        self.countdown -= 1
        return last or self.countdown <= 0 or self.ctx.backend is None or self.ctx.world_size == 1

    def __call__(self, code: int, last: bool, step_s: float) -> int:
        """At a voting boundary: this rank's stop code (0: none) -> the code all ranks stop with
        here (0: go on). `step_s`: this rank's last step time, for the period it proposes."""
        if self.ctx.backend is None or self.ctx.world_size == 1:
            return code
        agreed = self.result()
        if agreed:  # every rank read the same vote: all stop here and post no other
            return agreed
        proposal = max(1, min(MAX_VOTE_PERIOD, int(VOTE_EVERY_S / max(step_s, 1e-6))))
        flag = torch.tensor([code, proposal], dtype=torch.int32, device=self.ctx.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        self.pending = (work, flag)
        return self.result() if last else 0

    def result(self) -> int:
        """The pending vote's stop code (0 when none is pending); sets the next period."""
        if self.pending is None:
            return 0
        (work, flag), self.pending = self.pending, None
        work.wait()
        code, self.period = flag.tolist()
        self.countdown = self.period
        return code


def stop_at_boundary(cfg: Config, ctx: DistContext, tr: Training, run: RunState, run_dir: Path,
                     saved: bool, vote: StopVote, step_s: float) -> None:
    """At a step boundary where the ranks vote (StopVote): when any rank was asked to stop, all
    stop here, after a checkpoint when the signal asks for one and checkpoints are on; when the
    run directory is gone, all stop with an error (the same vote)."""
    if not vote.due(run.done):
        return
    gone = run.watch.problem() if run.watch is not None else None
    signum = vote(max(interrupt.requested() or 0, GONE if gone else 0), run.done, step_s)
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
    elif cfg.run.overwrite:
        rerun = "a rerun starts over"
    else:  # resume=auto and none are refused beside this run's metrics and no checkpoint
        rerun = "a rerun with run.overwrite=true starts over"
    if cfg.train.checkpoint_every:
        return f"; no checkpoint yet, {rerun}"
    return f"; no checkpoint (train.checkpoint_every=0), {rerun}"


def record_stop(run_dir: Path, stopped: Interrupted | None) -> None:
    """run.json: `interrupted` with the line and exit code; `done` once a later run completes it.
    A run.json that is not dtlab's record (the user's own file) is left as it is."""
    if not is_record(run_dir):
        return
    if stopped is not None and run_dir.is_dir():
        update_record(run_dir, status="interrupted", returncode=stopped.exit_code,
                      reason=stopped.line().removeprefix("dtlab: "), finished_at=now())
    elif stopped is None and (read_record(run_dir) or {}).get("status") == "interrupted":
        update_record(run_dir, status="done", reason="", returncode=0, finished_at=now())
