"""What a checkpoint holds for a training run, and putting it back (see checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlab.config import Config
from dtlab.distributed import DistContext
from dtlab.errors import PeerError
from dtlab.run import checkpoint, dir_watch
from dtlab.run import owner as run_owner
from dtlab.run.run_state import RunState, Training


def resume_path(cfg: Config, run_dir: Path, ctx: DistContext) -> Path | None:
    """The checkpoint to resume from. Every rank verifies it (in parallel; load() then reuses the
    result), the ranks compare their choices, and a problem is said once: by rank 0, or by the
    one rank that alone found it."""
    if cfg.resume == "none":
        return None
    choice, error = -1.0, None  # the step chosen, -1 none, -2 refused
    try:
        path = (checkpoint.newest_verified(run_dir, warn=ctx.is_main) if cfg.resume == "auto"
                else Path(cfg.resume))
        if path is not None:
            manifest = checkpoint.verify(path)
            run_owner.check_config(manifest, cfg.model_dump(mode="json"), path, run_dir)
            choice = float(manifest["step"])
    except checkpoint.CheckpointError as e:
        choice, error = -2.0, e
    choices = [c[0] for c in ctx.gather_floats([choice])]
    first = next((r for r, c in enumerate(choices) if c == -2.0), None)
    if first is not None:
        if first == ctx.rank:
            if "; fix: " in str(error):
                raise error  # type: ignore[misc]
            fix = ("set resume to another checkpoint (RUN/checkpoints/step_N)" if cfg.resume != "auto"
                   else "restore a complete checkpoint in run.dir")
            raise checkpoint.CheckpointError(f"{error}; fix: {fix}, or "
                                             f"{run_owner.start_over(run_dir)}") from None
        raise PeerError(f"rank {first} refused the checkpoint to resume from")
    if len(set(choices)) > 1:
        if ctx.is_main:
            raise checkpoint.CheckpointError(
                f"the ranks found different checkpoints to resume from in '{run_dir}' (steps "
                f"{sorted({int(c) for c in choices})}); fix: put run.dir on a file system every "
                "node sees")
        raise PeerError("the ranks found different checkpoints to resume from")
    if choice < 0:
        return None
    if cfg.resume == "auto":
        return checkpoint.checkpoint_root(run_dir) / f"step_{int(choice):06d}"
    return Path(cfg.resume)


def save(cfg: Config, ctx: DistContext, tr: Training, run: RunState) -> Path:
    """A checkpoint of this step, recording this run (never into a run directory that is gone)."""
    dir_watch.check_directory(ctx, run.watch, run.step)
    config = cfg.model_dump(mode="json")
    model_sd, optim_sd = tr.strategy.state_dict(tr.model, tr.optimizer, full=False)  # local shards
    scaler = tr.engine.scaler
    manifest = {
        "epoch": run.epoch, "strategy": cfg.strategy.name, "n_params": tr.n_params,
        "config": config, "run": run_owner.record(run.run_id, config),
        "scheduler": tr.scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "param_groups": optim_sd["param_groups"],  # hyper-parameters: JSON, not pickle
    }
    tensors = {"model": model_sd, "optim": optim_sd["state"]}
    path = checkpoint.save(Path(cfg.run.dir), run.step, tensors, manifest, ctx,
                           cfg.train.keep_checkpoints, tr.stepper.fault, run.watch)
    if ctx.is_main:
        run_owner.note_checkpoint(Path(cfg.run.dir), run.run_id, run.step)
    return path


def load(path: Path, cfg: Config, ctx: DistContext, tr: Training) -> dict[str, Any]:
    """Restore model, optimizer, schedule, scaler and RNG; returns the checkpoint's manifest."""
    model_sd, optim_sd = tr.strategy.state_dict(tr.model, tr.optimizer, full=False)  # to fill
    tensors = {"model": model_sd, "optim": optim_sd["state"]}
    manifest = checkpoint.load(path, tensors, ctx)
    tr.strategy.load_state_dict(tr.model, tr.optimizer, tensors["model"],
                                {"state": tensors["optim"], "param_groups": manifest["param_groups"]})
    tr.scheduler.load_state_dict(manifest["scheduler"])
    scaler = tr.engine.scaler
    if scaler is not None and manifest.get("scaler"):
        scaler.load_state_dict(manifest["scaler"])
    return manifest
