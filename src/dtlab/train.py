"""The training loop: one loop for every strategy.

    torchrun --nproc_per_node=N -m dtlab.train --config FILE [key=value ...]

Read `train()` top to bottom: data, model, strategy, optimizer, then the step: micro batches
(gradient sync only on the last), clip, optimizer step, schedule, log, evaluate.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import socket
import statistics
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab import __version__
from dtlab.config import (
    Config,
    ConfigError,
    check_environment,
    check_world,
    load_config,
    to_yaml,
)
from dtlab.data import DataSpec, EvalLoader, TrainLoader, build_datasets
from dtlab.distributed import DistContext, detect_env, distributed
from dtlab.errors import DtlabError, PeerError
from dtlab.metrics import MetricsLog, peak_memory, state_bytes, time_stats
from dtlab.models import build_model, count_params
from dtlab.optim import build_scheduler
from dtlab.strategies import Strategy, build_strategy


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy for class labels (B,) and for next tokens (B, T) alike, computed in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction
    )


@torch.no_grad()
def evaluate(model: nn.Module, loader: EvalLoader, strategy: Strategy, ctx: DistContext) -> dict:
    """Validation loss and accuracy over every sample once, reduced across ranks as sums."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    for x, y, mask in loader:
        with strategy.autocast():
            logits = model(x)
        weight = mask.view(-1, *[1] * (y.dim() - 1)).expand_as(y).double()
        per_item = loss_fn(logits, y, reduction="none").view(y.shape)
        totals += torch.stack([
            (per_item.double() * weight).sum(),
            ((logits.argmax(-1) == y).double() * weight).sum(),
            weight.sum(),
        ])
    ctx.all_reduce_sum(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}


def train(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    started = time.perf_counter()
    run_dir = Path(cfg.run.dir or "runs/default")
    t = cfg.train
    micro = check_world(cfg, ctx.world_size, ctx.env.local_world_size)

    train_set, val_set, spec = build_datasets(cfg, ctx)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank, for every strategy
    model = build_model(cfg.model, spec)
    n_params = count_params(model)
    strategy = build_strategy(cfg, ctx)
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model)  # after wrapping: over the shards this rank owns
    if t.compile:
        # A persistent cache: the first compile costs tens of seconds, later runs reuse it.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache/dtlab/inductor"))
    forward = torch.compile(model) if t.compile else model

    loader = TrainLoader(train_set, ctx.rank, ctx.world_size, micro, t.grad_accum_steps, cfg.seed)
    val_loader = EvalLoader(val_set, ctx.rank, ctx.world_size, cfg.data.val_batch_size or micro)
    total_steps = t.max_steps or t.epochs * loader.steps_per_epoch
    scheduler = build_scheduler(optimizer, t, total_steps)
    scaler = strategy.grad_scaler()
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank randomness (dropout) from here on

    log = MetricsLog(run_dir, ctx.is_main, total_steps, cfg.run.progress, cfg.run.tensorboard)
    if ctx.is_main:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokens_per_sample = spec.seq_len if spec.kind == "tokens" else 0
    step_times: list[float] = []
    data_times: list[float] = []
    epoch_times: list[float] = []
    last_loss = float("nan")
    evals: dict[str, Any] = {}

    model.train()
    for step, (epoch, step_idx) in enumerate(islice(loader.steps(), total_steps), start=1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        batches = [train_set.batch(i) for i in step_idx]
        ctx.synchronize()
        data_time = time.perf_counter() - t0
        step_loss = torch.zeros((), device=ctx.device)
        for i, (x, y) in enumerate(batches):
            last_micro = i == len(batches) - 1
            with contextlib.nullcontext() if last_micro else strategy.no_sync(model):
                with strategy.autocast():
                    loss = loss_fn(forward(x), y) / t.grad_accum_steps
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if t.grad_clip:
            if scaler:
                scaler.unscale_(optimizer)
            strategy.clip_grad_norm_(model, t.grad_clip)
        lr = scheduler.get_last_lr()[0]
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        ctx.synchronize()
        step_time = time.perf_counter() - t0
        step_times.append(step_time)
        data_times.append(data_time)

        if step % cfg.run.log_every == 0 or step == total_steps:
            last_loss = ctx.all_reduce_sum(step_loss).item() / ctx.world_size
            record = {
                "step": step, "epoch": epoch, "loss": last_loss, "lr": lr,
                "step_time_s": step_time, "data_time_s": data_time,
                "samples_per_s": t.global_batch_size / step_time,
            }
            if tokens_per_sample:
                record["tokens_per_s"] = record["samples_per_s"] * tokens_per_sample
            log.log(record, quiet=log.bar is not None)
        log.advance(1, last_loss)
        end_of_epoch = step % loader.steps_per_epoch == 0
        if end_of_epoch:  # training time of a complete epoch (evaluation not included)
            epoch_times.append(sum(step_times[-loader.steps_per_epoch:]))
        if (t.eval_every and step % t.eval_every == 0) or (not t.eval_every and end_of_epoch) or (
            step == total_steps
        ):
            evals = {"step": step, "epoch": epoch, **evaluate(forward, val_loader, strategy, ctx)}
            log.log(evals)

    summary = summarize(cfg, ctx, strategy, spec, model, optimizer, n_params, micro, step_times,
                        data_times, last_loss, evals, time.perf_counter() - started)
    summary["steps_per_epoch"] = loader.steps_per_epoch
    # Measured when at least one epoch completed, else the median step time x steps per epoch.
    summary["epoch_time_measured"] = bool(epoch_times)
    summary["epoch_time_s"] = (statistics.median(epoch_times) if epoch_times
                               else summary["median_step_time_s"] * loader.steps_per_epoch)
    if cfg.run.save_model:
        save_model(strategy, model, run_dir / "model.safetensors", ctx)
    log.write_summary(summary)
    log.close()
    return summary


def summarize(cfg: Config, ctx: DistContext, strategy: Strategy, spec: DataSpec, model: nn.Module,
              optimizer: torch.optim.Optimizer, n_params: int, micro: int, step_times: list[float],
              data_times: list[float], last_loss: float, evals: dict[str, Any],
              wall: float) -> dict[str, Any]:
    """summary.json: every number measured here, per rank where ranks differ."""
    warm = cfg.run.timing_warmup_steps
    timed = step_times[warm:] or step_times  # warm-up steps (allocation, compilation) excluded
    stats = time_stats(timed)
    mem, state = peak_memory(ctx.device), state_bytes(model, optimizer)
    per_rank = ctx.gather_floats([*mem.values(), *state.values()])
    keys = [*mem, *state]
    gb = cfg.train.global_batch_size
    summary: dict[str, Any] = {
        "strategy": cfg.strategy.name,
        "strategy_options": strategy.describe(),
        "world_size": ctx.world_size,
        "nnodes": ctx.env.nnodes,
        "launcher": ctx.env.launcher,
        "backend": ctx.backend or "none",
        "device": ctx.device.type,
        "device_name": device_name(ctx.device),
        "threads_per_rank": ctx.threads,
        "model": cfg.model.name,
        "n_params": n_params,
        "data": cfg.data.name,
        "precision": cfg.train.precision,
        "compile": cfg.train.compile,
        "global_batch_size": gb,
        "micro_batch_size": micro,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "steps": len(step_times),
        "timed_steps": len(timed),
        "samples_seen": len(step_times) * gb,
        "median_step_time_s": stats.get("median"),
        "step_time_s": stats,
        "median_data_time_s": time_stats(data_times[warm:] or data_times).get("median"),
        "samples_per_s": len(timed) * gb / sum(timed) if timed else None,
        "final_train_loss": last_loss,
        "val_loss": evals.get("val_loss"),
        "val_acc": evals.get("val_acc"),
        "memory_per_rank": {k: [int(r[i]) for r in per_rank] for i, k in enumerate(keys)},
        "torch_version": torch.__version__,
        "dtlab_version": __version__,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "seed": cfg.seed,
        "wall_time_s": wall,
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if spec.kind == "tokens" and summary["samples_per_s"]:
        summary["tokens_per_s"] = summary["samples_per_s"] * spec.seq_len
    return summary


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def save_model(strategy: Strategy, model: nn.Module, path: Path, ctx: DistContext) -> None:
    """Gather the full state dict (every rank takes part) and write it from rank 0."""
    from safetensors.torch import save_file

    state, _ = strategy.state_dict(model)
    if ctx.is_main:
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in state.items()}, str(path))


def run(config: str | None, overrides: list[str]) -> int:
    """Worker entry: validate, set up the process group, train, always tear down. Returns exit code."""
    env = detect_env()
    try:
        cfg = load_config(config, overrides)
        check_world(cfg, env.world_size, env.local_world_size)
        check_environment(cfg)
    except ConfigError as e:
        if env.rank == 0:  # every rank finds the same problem: say it once
            print(f"dtlab: error: {e}", file=sys.stderr)
        return 2
    try:
        r = cfg.run
        with distributed(r.device, r.backend, r.timeout_s, r.threads,
                         need_group=cfg.strategy.name != "single", env=env) as ctx:
            train(cfg, ctx)
    except DtlabError as e:
        if not isinstance(e, PeerError):  # the rank that failed first-hand explains it
            where = f"[rank {env.rank}] " if env.world_size > 1 else ""
            print(f"dtlab: error: {where}{e}", file=sys.stderr)
        return e.exit_code
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the built-in quick config)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.1")
    args = parser.parse_args(argv)
    return run(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
