"""The training loop: one loop for every strategy.

    torchrun --nproc_per_node=N -m dtlab.train --config FILE [key=value ...]
    deepspeed --num_gpus N --module dtlab.train [key=value ...]   (strategy.name=deepspeed)

Read `train()` top to bottom: data, model, strategy, optimizer, resume, then for each step: the
step (dtlab/step.py), log, evaluate, checkpoint; then the summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from dtlab import checkpoint, state
from dtlab.config import (
    Config,
    ConfigError,
    check_environment,
    check_world,
    load_config,
    to_yaml,
)
from dtlab.data import EvalLoader, SampleUsage, TrainLoader, build_datasets
from dtlab.distributed import (
    DistContext,
    detect_env,
    distributed,
    is_comm_failure,
    leave,
    who_stopped,
)
from dtlab.errors import DtlabError, PeerError, RunError
from dtlab.faults import Fault
from dtlab.metrics import MetricsLog
from dtlab.models import build_model, count_params
from dtlab.optim import build_scheduler
from dtlab.step import Stepper
from dtlab.strategies import build_strategy
from dtlab.summary import comm_breakdown, save_model, summarize


def train(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    started = time.perf_counter()
    run_dir = Path(cfg.run.dir or "runs/default")
    t = cfg.train
    micro = check_world(cfg, ctx.world_size, ctx.env.local_world_size)

    train_set, val_set, spec = build_datasets(cfg, ctx)
    # Identical initial weights on every rank, for every strategy (unless the lab switch breaks it).
    torch.manual_seed(cfg.seed + (ctx.rank if cfg.lab.per_rank_init_seed else 0))
    model = build_model(cfg.model, spec)
    n_params = count_params(model)
    strategy = build_strategy(cfg, ctx)
    model = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model)  # after wrapping: over the shards this rank owns
    if t.compile:
        # A persistent cache: the first compile costs tens of seconds, later runs reuse it.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache/dtlab/inductor"))
    forward = torch.compile(model) if t.compile else model

    # Batches are dealt to data-parallel replicas (all ranks of one replica see the same samples);
    # without a distributed sampler every rank draws the whole data set's batches itself.
    dp_rank, dp_size = (0, 1) if cfg.lab.no_distributed_sampler else (strategy.dp_rank, strategy.dp_size)
    loader = TrainLoader(train_set, dp_rank, dp_size, micro, t.grad_accum_steps, cfg.seed)
    val_loader = EvalLoader(val_set, strategy.dp_rank, strategy.dp_size,
                            cfg.data.val_batch_size or micro, pad=not cfg.lab.uneven_eval)
    usage = SampleUsage(len(train_set)) if cfg.run.track_samples else None
    total_steps = t.max_steps or t.epochs * loader.steps_per_epoch
    scheduler = build_scheduler(optimizer, t, total_steps)
    fault = Fault(cfg.run.fault, ctx.rank)
    run_step = Stepper(cfg, strategy, model, forward, optimizer, scheduler, ctx.device, fault)
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank randomness (dropout) from here on

    # Resume: model, optimizer, schedule, RNG and the position in the data order.
    start = 0
    path = state.resume_path(cfg, run_dir, warn=ctx.is_main)
    if path is not None:
        start = state.load(path, cfg, ctx, strategy, model, optimizer, scheduler,
                           run_step.scaler)["step"]
        run_step.step_number = start
    log = MetricsLog(run_dir, ctx.is_main, total_steps, cfg.run.progress, cfg.run.tensorboard,
                     resume_step=start if path is not None else None)
    if path is not None and ctx.is_main:
        done = " (the run is complete: evaluating only; resume=none starts over)" if start >= total_steps else ""
        print(f"dtlab: resuming from {path} at step {start}{done}; steps lost since that "
              f"checkpoint: {log.lost_steps}", file=sys.stderr, flush=True)
    if ctx.is_main:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokens_per_sample = spec.seq_len if spec.kind == "tokens" else 0
    step_times: list[float] = []
    data_times: list[float] = []
    epoch_times: list[float] = []
    last_loss = float("nan")
    evals: dict[str, Any] = {}
    epoch = start // loader.steps_per_epoch

    def save_checkpoint(step: int) -> None:
        state.save(cfg, ctx, strategy, model, optimizer, scheduler, run_step.scaler, step, epoch,
                   n_params, fault)

    model.train()
    steps = enumerate(islice(loader.steps(start), max(0, total_steps - start)), start=start + 1)
    step = start
    try:
        for step, (epoch, step_idx) in steps:
            fault.before_step(step)
            t0 = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            batches = [train_set.batch(i) for i in step_idx]
            if usage is not None:
                usage.add(step_idx)
            ctx.synchronize()
            data_time = time.perf_counter() - t0
            step_loss = run_step(batches)
            ctx.synchronize()
            step_time = time.perf_counter() - t0
            step_times.append(step_time)
            data_times.append(data_time)

            if step % cfg.run.log_every == 0 or step == total_steps:
                last_loss = strategy.mean_loss(step_loss)
                record = {
                    "step": step, "epoch": epoch, "loss": last_loss, "lr": lr,
                    "step_time_s": step_time, "data_time_s": data_time,
                    "samples_per_s": t.global_batch_size / step_time,
                }
                if tokens_per_sample:
                    record["tokens_per_s"] = record["samples_per_s"] * tokens_per_sample
                log.log(record, quiet=log.bar is not None)
            log.advance(step, last_loss)
            end_of_epoch = step % loader.steps_per_epoch == 0
            if end_of_epoch and len(step_times) >= loader.steps_per_epoch:
                epoch_times.append(sum(step_times[-loader.steps_per_epoch:]))  # training only
            if (t.eval_every and step % t.eval_every == 0) or (not t.eval_every and end_of_epoch) \
                    or step == total_steps:
                evals = {"step": step, "epoch": epoch, **strategy.evaluate(forward, val_loader)}
                log.log(evals)
            if t.checkpoint_every and step % t.checkpoint_every == 0:
                save_checkpoint(step)
        if not evals:  # resumed a finished run: evaluate what it left
            evals = {"step": step, "epoch": epoch, **strategy.evaluate(forward, val_loader)}
            log.log(evals)
        if t.checkpoint_every and not (checkpoint.checkpoint_root(run_dir) / f"step_{step:06d}").is_dir():
            save_checkpoint(step)  # the end of the run (or of a resumed run, here in run.dir)
    except RuntimeError as e:
        if ctx.world_size > 1 and is_comm_failure(e):
            raise RunError(who_stopped(ctx, step, e)) from None
        raise

    summary = summarize(cfg, ctx, strategy, spec, model, optimizer, n_params, micro, step_times,
                        data_times, last_loss, evals, time.perf_counter() - started)
    summary["steps_per_epoch"] = loader.steps_per_epoch
    # Measured when at least one epoch completed, else the median step time x steps per epoch.
    summary["epoch_time_measured"] = bool(epoch_times)
    summary["epoch_time_s"] = (statistics.median(epoch_times) if epoch_times
                               else (summary["median_step_time_s"] or 0) * loader.steps_per_epoch)
    summary["skipped_steps"] = run_step.skipped
    if usage is not None:
        summary["sample_usage"] = usage.summary(strategy)
    if path is not None:
        summary["resumed_from"] = {"path": str(path), "step": start, "lost_steps": log.lost_steps}
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
                         need_group=cfg.strategy.name != "single", env=env,
                         destroy=not cfg.lab.no_destroy_process_group) as ctx:
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
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return run(args.config, args.overrides)


if __name__ == "__main__":
    leave(main())
