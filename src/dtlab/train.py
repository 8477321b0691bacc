"""The training loop: one loop for every strategy.

    torchrun --nproc_per_node=N -m dtlab.train --config FILE [key=value ...]

Read `train()` top to bottom: data, model, strategy, optimizer, then the step: micro batches
(gradient sync only on the last), clip, optimizer step, schedule, log, evaluate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.config import (
    Config,
    ConfigError,
    check_environment,
    check_world,
    load_config,
    to_yaml,
)
from dtlab.data import EvalLoader, TrainLoader, build_datasets
from dtlab.distributed import DistContext, detect_env, distributed
from dtlab.errors import DtlabError, PeerError
from dtlab.metrics import MetricsLog
from dtlab.models import build_model, count_params, loss_fn
from dtlab.optim import build_scheduler
from dtlab.strategies import Strategy, build_strategy
from dtlab.summary import comm_breakdown, save_model, summarize


class Stepper:
    """One optimizer step over a step's micro batches. Gradients are synchronised on the last micro
    batch only; `sync=False` keeps every micro batch local (the compute-only step of DDP)."""

    def __init__(self, cfg: Config, strategy: Strategy, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, device: torch.device) -> None:
        self.t, self.strategy, self.model, self.forward = cfg.train, strategy, model, forward
        self.optimizer, self.scheduler, self.device = optimizer, scheduler, device
        self.scaler = strategy.grad_scaler()

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], sync: bool = True) -> torch.Tensor:
        t, strategy, scaler = self.t, self.strategy, self.scaler
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            local = not sync or i < len(batches) - 1
            with strategy.no_sync(self.model) if local else contextlib.nullcontext():
                with strategy.autocast():
                    loss = loss_fn(self.forward(x), y) / t.grad_accum_steps
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if t.grad_clip:
            if scaler:
                scaler.unscale_(self.optimizer)
            strategy.clip_grad_norm_(self.model, t.grad_clip)
        if scaler:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return step_loss


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
    run_step = Stepper(cfg, strategy, model, forward, optimizer, scheduler, ctx.device)
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
        lr = scheduler.get_last_lr()[0]
        batches = [train_set.batch(i) for i in step_idx]
        ctx.synchronize()
        data_time = time.perf_counter() - t0
        step_loss = run_step(batches)
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
    if cfg.run.comm_breakdown and ctx.world_size > 1:  # after training: it changes the model
        more = [[train_set.batch(i) for i in idx] for _, idx in
                islice(loader.steps(start_step=total_steps), cfg.run.breakdown_steps)]
        trace = run_dir / f"trace_rank{ctx.rank}.json" if cfg.run.profile_trace else None
        summary.update(comm_breakdown(cfg, ctx, strategy, spec, n_params, run_step, more, trace))
    log.write_summary(summary)
    log.close()
    return summary


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
