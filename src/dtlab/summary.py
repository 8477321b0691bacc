"""What a run reports: summary.json's numbers, the final model, and the compute/communication
breakdown (`run.comm_breakdown`)."""

from __future__ import annotations

import datetime
import platform
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab import __version__
from dtlab.comm.breakdown import analytic_bytes, measure
from dtlab.config import Config
from dtlab.data import DataSpec
from dtlab.distributed import DistContext
from dtlab.metrics import peak_memory, time_stats
from dtlab.models import build_model, loss_fn
from dtlab.optim import build_optimizer
from dtlab.strategies import Strategy
from dtlab.strategies.base import autocast


def summarize(cfg: Config, ctx: DistContext, strategy: Strategy, spec: DataSpec, model: nn.Module,
              optimizer: torch.optim.Optimizer, n_params: int, micro: int, step_times: list[float],
              data_times: list[float], last_loss: float, evals: dict[str, Any],
              wall: float) -> dict[str, Any]:
    """summary.json: every number measured here, per rank where ranks differ."""
    warm = cfg.run.timing_warmup_steps
    timed = step_times[warm:] or step_times  # warm-up steps (allocation, compilation) excluded
    stats = time_stats(timed)
    mem, state = peak_memory(ctx.device), strategy.state_bytes(model, optimizer)
    index = ctx.device.index if ctx.device.index is not None else -1
    per_rank = ctx.gather_floats([*mem.values(), *state.values(), ctx.env.local_rank, index])
    keys = [*mem, *state]
    # Where each rank ran: the local rank (its index on its node) picks the device.
    layout = [{"local_rank": int(r[-2]), "device": f"{ctx.device.type}:{int(r[-1])}"
               if r[-1] >= 0 else ctx.device.type} for r in per_rank]
    gb = cfg.train.global_batch_size
    summary: dict[str, Any] = {
        "strategy": cfg.strategy.name,
        "strategy_options": strategy.describe(),
        "world_size": ctx.world_size,
        "nnodes": ctx.env.nnodes,
        "ranks": layout,
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
        "val_acc_own_samples_per_rank": evals.get("val_acc_own_samples_per_rank"),
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
    summary.update(strategy.measurements())
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


def comm_breakdown(cfg: Config, ctx: DistContext, strategy: Strategy, spec: DataSpec,
                   n_params: int, run_step: Callable[..., Any], batches: list[Any],
                   trace: Path | None) -> dict[str, Any]:
    """Measure compute vs communication on `batches` (see dtlab/comm/breakdown.py)."""
    s = cfg.strategy
    no_sync_is_local = s.name == "ddp" or (s.name == "fsdp1" and s.fsdp1.sharding_strategy == "NO_SHARD")
    if no_sync_is_local:
        def compute_only(b: Any) -> Any:
            return run_step(b, sync=False)
    else:  # FSDP all-gathers even without gradient sync: time a plain replica instead
        replica = build_model(cfg.model, spec).to(ctx.device)
        opt = build_optimizer(replica.parameters(), cfg.train)

        def compute_only(b: Any) -> Any:
            opt.zero_grad(set_to_none=True)
            for x, y in b:
                with autocast(cfg.train.precision, ctx.device):
                    loss = loss_fn(replica(x), y) / cfg.train.grad_accum_steps
                loss.backward()
            opt.step()

    low = cfg.train.precision != "fp32" and s.name in ("fsdp", "fsdp1")
    options = strategy.describe()
    analytic = analytic_bytes(s.name, options, n_params, 2 if low else 4, 4, ctx.world_size)
    result = measure(run_step, compute_only, batches, ctx.synchronize, ctx.gather_floats,
                     ctx.world_size, analytic, trace)
    flat = {k: result[k] for k in ("comm_share", "exposed_comm_s", "compute_time_s", "comm_time_s",
                                   "overlapped_comm_s")}
    return {**flat, "comm_breakdown": result}

