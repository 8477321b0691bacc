"""What a run reports: summary.json's numbers, the final model, and the compute/communication
breakdown (`run.comm_breakdown`)."""

from __future__ import annotations

import datetime
import platform
import socket
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab import __version__, files
from dtlab.config import Config
from dtlab.config.layout import layout_of
from dtlab.config.strategies import registry
from dtlab.distributed import DistContext
from dtlab.errors import RunError
from dtlab.instruments.breakdown import measure
from dtlab.instruments.flops import utilization
from dtlab.instruments.machine_load import timing_record
from dtlab.instruments.metrics import peak_memory, time_stats
from dtlab.levers import numerics
from dtlab.levers.optim import build_optimizer, impl_of
from dtlab.models import build_model, loss_fn, memory_format
from dtlab.run.loop_overhead import loop_record
from dtlab.run.run_state import RunState, Training
from dtlab.strategies.base import Strategy, autocast


def summarize(cfg: Config, ctx: DistContext, tr: Training, run: RunState) -> dict[str, Any]:
    """summary.json: every number measured here, per rank where ranks differ."""
    warm = cfg.run.timing_warmup_steps
    step_times, spec = run.step_times, tr.spec
    timed = step_times[warm:] or step_times  # warm-up steps (allocation, compilation) excluded
    stats = time_stats(timed)
    mem, state = {**run.peaks, **peak_memory(ctx.device)}, tr.strategy.state_bytes(tr.model, tr.optimizer)
    index = ctx.device.index if ctx.device.index is not None else -1
    per_rank = ctx.gather_floats([*mem.values(), *state.values(), ctx.env.local_rank, index])
    keys = [*mem, *state]
    # Where each rank ran: the local rank (its index on its node) picks the device.
    layout = [{"local_rank": int(r[-2]), "device": f"{ctx.device.type}:{int(r[-1])}"
               if r[-1] >= 0 else ctx.device.type} for r in per_rank]
    evals = run.evals
    gb = cfg.train.global_batch_size
    summary: dict[str, Any] = {
        "strategy": cfg.strategy.name,
        "strategy_options": tr.strategy.describe(),
        # the data-parallel flavour @ the model-parallel degrees (config/layout.py): fsdp@tp2
        "layout": layout_of(cfg, ctx.world_size).text(),
        "world_size": ctx.world_size,
        "nnodes": ctx.env.nnodes,
        "ranks": layout,
        "launcher": ctx.env.launcher,
        "backend": ctx.backend or "none",
        "device": ctx.device.type,
        "device_name": device_name(ctx.device),
        "threads_per_rank": ctx.threads,
        "model": cfg.model.name,
        "n_params": tr.n_params,
        "data": cfg.data.name,
        "precision": cfg.train.precision,
        "compile": cfg.train.compile,
        "channels_last": memory_format.wanted(cfg.model, ctx.device),
        **numerics.settings(cfg.run, ctx.device),
        "optimizer_impl": impl_of(tr.optimizer),
        "global_batch_size": gb,
        "micro_batch_size": tr.micro_batch,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "steps": len(step_times),
        "timed_steps": len(timed),
        "samples_seen": len(step_times) * gb,
        "median_step_time_s": stats.get("median"),
        "step_time_s": stats,
        "median_data_time_s": time_stats(run.data_times[warm:] or run.data_times).get("median"),
        **loop_record(run.loop_times, run.engine_times, warm, ctx.device),
        # the median step, as the step time, TFLOP/s and MFU: one statistic for every speed
        "samples_per_s": gb / stats["median"] if stats.get("median", 0) > 0 else None,
        "final_train_loss": run.last_loss,
        "val_loss": evals.get("val_loss"),
        "val_acc": evals.get("val_acc"),
        "val_acc_own_samples_per_rank": evals.get("val_acc_own_samples_per_rank"),
        "memory_per_rank": {k: [int(r[i]) for r in per_rank] for i, k in enumerate(keys)},
        "torch_version": torch.__version__,
        "dtlab_version": __version__,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "seed": cfg.seed,
        "wall_time_s": run.wall_time,
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if spec.kind == "tokens" and summary["samples_per_s"]:
        summary["tokens_per_s"] = summary["samples_per_s"] * spec.seq_len
    timing = timing_record(run.load, ctx.threads, ctx.gather_floats, stats, len(timed))
    if ctx.is_main:  # the same on every rank; only rank 0's summary is written
        summary.update(utilization(cfg, spec, ctx.device, summary["device_name"], ctx.threads,
                                   ctx.world_size, stats.get("median"), run.load.cpu_tflops,
                                   timing["unreliable"]))
    summary.update(tr.engine.measurements())
    summary["steps_per_epoch"] = run.steps_per_epoch
    summary["epoch_time_s"], summary["epoch_time_measured"] = run.epoch_time(stats.get("median"))
    summary["skipped_steps"] = tr.stepper.skipped
    summary["timing"] = timing
    if run.usage is not None:
        summary["sample_usage"] = run.usage.summary(tr.strategy)
    if run.resumed_from is not None:
        summary["resumed_from"] = {"path": str(run.resumed_from), "step": run.start,
                                   "lost_steps": run.lost_steps}
    return summary


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def save_model(strategy: Strategy, model: nn.Module, path: Path, ctx: DistContext) -> None:
    """Gather the full state dict (every rank takes part) and write it from rank 0."""
    from safetensors.torch import save_file

    state, _ = strategy.state_dict(model)
    if not ctx.is_main:
        return
    state = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
    files.write_whole(path, lambda tmp: save_file(state, str(tmp)),
                      f"writing run.save_model's '{path}'", "run.dir", RunError)


def comm_breakdown(cfg: Config, ctx: DistContext, tr: Training, batches: list[Any],
                   trace: Path | None) -> dict[str, Any]:
    """Measure compute vs communication on `batches` (see dtlab/instruments/breakdown.py)."""
    engine, strategy = tr.engine, tr.strategy
    if strategy.no_sync_is_local:
        def compute_only(b: Any) -> Any:
            engine.zero_grad()
            for x, y in b:
                engine.micro_step(x, y, tr.stepper.loss_hook, sync=False)
            engine.step()
    else:  # FSDP all-gathers even without gradient sync: time a plain replica instead
        replica = build_model(cfg.model, tr.spec, cfg.train.lora).to(ctx.device)
        opt = build_optimizer(replica.parameters(), cfg.train)

        def compute_only(b: Any) -> Any:
            opt.zero_grad(set_to_none=True)
            for x, y in b:
                with autocast(cfg.train.precision, ctx.device):
                    loss = loss_fn(replica(x), y) / cfg.train.grad_accum_steps
                loss.backward()
            opt.step()

    low = cfg.train.precision != "fp32" and strategy.wrapper_casts  # parameters gathered in 16 bits
    comm_bytes = registry.of(cfg).comm_bytes
    analytic = comm_bytes(strategy.describe(), tr.n_params, 2 if low else 4, 4,
                          ctx.world_size) if comm_bytes else None
    result = measure(tr.stepper, compute_only, batches, ctx.synchronize, ctx.gather_floats,
                     ctx.world_size, analytic, trace)
    flat = {k: result[k] for k in ("comm_share", "exposed_comm_s", "compute_time_s", "comm_time_s",
                                   "overlapped_comm_s", "other_overhead_s")}
    return {**flat, "comm_breakdown": result}
