"""Exact per-rank bytes of DeepSpeed ZeRO 1, 2 and 3 (deepspeed 0.19.8), without DeepSpeed.

What `strategies/deepspeed_memory.py` measures on a real engine (summary.json memory_per_rank: the
largest value of each kind just before and after the first optimizer steps), derived from how
`runtime/zero/stage_1_and_2.py`, `stage3.py` and `parameter_offload.py` lay the state out. n =
data-parallel ranks, e = bytes per element of the working parameters (fp32 4, bf16/fp16 2); the
master weights and optimizer state are always fp32.

Stages 1 and 2 (`DeepSpeedZeroOptimizer`):
- parameters: all of them, flattened into one buffer of N elements padded to a multiple of 2n
  (`nccl_start_alignment_factor` x n); the module's parameters are views into it.
- master weights: rank r's contiguous 1/n of that buffer, in fp32 (even in fp32 training), and
  the optimizer state of that one flat tensor (AdamW: 2 x 4 bytes per element + its 4-byte step).
- gradients: after the reduction each rank keeps the gradients of every tensor that has an
  element in its slice, at the tensors' whole size (a tensor straddling two slices is held by
  both), plus zeros for the part of its slice that lies in the padding. Between accumulation
  micro batches stage 1 holds every gradient whole, and its reduce bucket.
- offload_optimizer: the gradients go straight into an fp32 `.grad` of the master slice; DeepSpeed
  allocates a copy of the slice in the working dtype and two staging buffers as large as the
  largest tensor (one in host memory, one on the device).

Stage 3 (`DeepSpeedZeroOptimizer_Stage3`):
- parameters: each tensor is split into n parts of ceil(numel / n) elements (padded); rank r holds
  part r of every tensor (one flat buffer). Tensors with at most
  `stage3_param_persistence_threshold` elements (default 100,000) are *persistent*: after the
  first forward they stay gathered, at their padded size n x ceil(numel / n), beside their part.
- gradients: one flat buffer of this rank's parts (+ an fp32 `.grad` of the master parts under
  offload_optimizer). master + optimizer state: fp32 of the parts, per sub group of
  `sub_group_size` elements (one AdamW step tensor each).
- buffers: the reduce bucket, `reduce_bucket_size` elements allocated at init when
  `contiguous_gradients` (the default), whatever the model size.

Buffers below are the allocations that persist between steps; DeepSpeed's few scalars (norms,
flags; under 1 KiB) are not counted. Knobs that change the layout and are not modelled (ZeRO++,
round-robin gradients, parameter alignment, NVMe offload, ...) raise DtlabError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from dtlab.config import Config
from dtlab.errors import DtlabError

RankBytes = dict[str, int]
ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER = 4  # fp32 master weights and gradients of the optimizer

# zero_optimization keys that change what is allocated and are not modelled here: (key, the
# value DeepSpeed 0.19.8 defaults to, which is the only one accepted).
# (cpu_offload and cpu_offload_params: deprecated spellings of the offload sections.)
UNMODELLED = (("round_robin_gradients", False), ("parameter_alignment", False),
              ("zero_hpz_partition_size", 1), ("zero_quantized_weights", False),
              ("zero_quantized_gradients", False), ("cpu_offload", False),
              ("cpu_offload_params", False))


@dataclass(frozen=True)
class ZeroOptions:
    """The zero_optimization settings the layout depends on, with DeepSpeed 0.19.8's defaults."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool = False  # DeepSpeed's default: True for stage 3 only
    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    sub_group_size: int = 1_000_000_000


def _get(zero: dict[str, Any], key: str, alias: str | None, default: Any) -> Any:
    for name in (key, alias):
        if name and zero.get(name) is not None:
            return zero[name]
    return default


def _offloaded(zero: dict[str, Any], key: str) -> bool:
    device = (zero.get(key) or {}).get("device", "none")
    if device == "nvme":
        raise DtlabError(f"zero_optimization.{key}.device=nvme: no exact layout for NVMe offload; "
                         "fix: estimate with device cpu or none")
    return device not in (None, "none")


def zero_stage(cfg: Config) -> int:
    """The ZeRO stage a run of `cfg` uses (strategy.deepspeed.zero_stage, else the JSON's)."""
    from dtlab.strategies.deepspeed_config import DEFAULT_STAGE, read_json

    o = cfg.strategy.deepspeed
    if o.zero_stage is not None:
        return o.zero_stage
    zero = (read_json(o.config) if o.config else {}).get("zero_optimization") or {}
    return int(zero.get("stage", DEFAULT_STAGE))


def zero_options(cfg: Config, world: int, device: str = "cpu") -> ZeroOptions:
    """The options a run of `cfg` gives DeepSpeed (dtlab's own config mapping, JSON included)."""
    from dtlab.strategies.deepspeed_config import deepspeed_config

    ds = deepspeed_config(cfg, world, device)
    zero = ds["zero_optimization"]
    for key, default in UNMODELLED:
        if zero.get(key) not in (None, default):
            raise DtlabError(f"zero_optimization.{key}={json.dumps(zero[key])}: no exact layout "
                             f"for it; fix: remove it from the DeepSpeed JSON to estimate (only "
                             f"{json.dumps(default)} is modelled)")
    if (ds.get("data_types") or {}).get("grad_accum_dtype") not in (None, cfg.train.precision):
        raise DtlabError("data_types.grad_accum_dtype other than the working dtype has no exact "
                         "layout; fix: remove it from the DeepSpeed JSON to estimate")
    if ds.get("communication_data_type") not in (None, cfg.train.precision):
        raise DtlabError("communication_data_type has no exact layout; fix: remove it from the "
                         "DeepSpeed JSON to estimate")
    stage = zero["stage"]
    return ZeroOptions(
        stage=stage,
        offload_optimizer=_offloaded(zero, "offload_optimizer"),
        offload_param=_offloaded(zero, "offload_param"),
        reduce_bucket_size=int(_get(zero, "reduce_bucket_size", None, 500_000_000)),
        contiguous_gradients=bool(_get(zero, "contiguous_gradients", None, True)),
        overlap_comm=bool(_get(zero, "overlap_comm", None, stage == 3)),
        persistence_threshold=int(_get(zero, "param_persistence_threshold",
                                       "stage3_param_persistence_threshold", 100_000)),
        model_persistence_threshold=int(_get(zero, "model_persistence_threshold",
                                             "stage3_model_persistence_threshold", 2**63 - 1)),
        sub_group_size=int(_get(zero, "sub_group_size", None, 1_000_000_000)),
    )


def optimizer_state(numel: int, optimizer: str, momentum: float, flats: int = 1) -> int:
    """fp32 state of `flats` flat tensors holding `numel` elements in all."""
    if optimizer == "adamw":  # exp_avg, exp_avg_sq, and one 4-byte `step` per flat tensor
        return 2 * 4 * numel + 4 * flats
    return 4 * numel if momentum > 0 else 0  # SGD's momentum buffer


# --------------------------------------------------------------------------------- stages 1, 2
def slice_grad_elements(numels: list[int], part: int, rank: int) -> tuple[int, int]:
    """(elements of the whole tensors touching rank's slice of the flat buffer, zero padding).
    DeepSpeed's get_partition_info and get_flat_partition: a tensor belongs to the slice it
    starts in, and also to the slice it runs into."""
    lo, hi = rank * part, (rank + 1) * part
    whole = covered = offset = 0
    for n in numels:
        if n and (lo <= offset < hi or offset < lo < offset + n):
            whole += n
            covered += min(offset + n, hi) - max(offset, lo)
        offset += n
    if not whole:
        return 0, part  # a slice entirely in the padding: one zero tensor
    return whole, part - covered


def stage12(numels: list[int], o: ZeroOptions, world: int, elem: int, optimizer: str,
            momentum: float, accum_steps: int) -> list[RankBytes]:
    total = sum(numels)
    align = 2 * world
    flat = math.ceil(total / align) * align
    part = flat // world
    largest = max(numels, default=0)
    bucket = o.reduce_bucket_size * elem * (2 if o.overlap_comm else 1) if o.contiguous_gradients else 0
    out = []
    for rank in range(world):
        whole, pad = slice_grad_elements(numels, part, rank)
        master, state = MASTER * part, optimizer_state(part, optimizer, momentum)
        grads, buffers, host, host_buffers = (whole + pad) * elem, 0, 0, 0
        if o.offload_optimizer:
            grads = MASTER * part  # the master slice's fp32 .grad
            host_buffers = part * elem + largest * elem  # the slice in the working dtype, staging
            buffers = host_buffers + largest * elem  # + the device-side staging buffer
            host = master + state + grads
            if accum_steps > 1 and o.stage == 2:  # per-tensor accumulators in host memory
                grads += whole * elem
                host += whole * elem
        if accum_steps > 1 and o.stage == 1:  # every gradient whole until the boundary reduces
            grads = max(grads, total * elem) if not o.offload_optimizer else grads + total * elem
            buffers += bucket
        out.append({"param_bytes": flat * elem, "grad_bytes": grads,
                    "optim_bytes": master + state, "master_bytes": master,
                    "buffer_bytes": buffers, "host_bytes": host,
                    "host_buffer_bytes": host_buffers,
                    "backward_buffer_bytes": 0 if accum_steps > 1 and o.stage == 1 else bucket})
    return out


# ------------------------------------------------------------------------------------ stage 3
def persistent(numels: list[int], o: ZeroOptions) -> list[bool]:
    """parameter_offload.mark_persistent_parameters: small tensors, in the module's order, until
    the model-wide budget is spent."""
    out, kept = [], 0
    for n in numels:
        keep = n + kept <= o.model_persistence_threshold and n <= o.persistence_threshold
        kept += n if keep else 0
        out.append(keep)
    return out


def sub_groups(parts: list[int], size: int) -> int:
    """stage3._create_fp16_sub_groups: consecutive tensors until `size` partition elements."""
    if size >= sum(parts):
        return 1
    groups, run = 0, 0
    for i, p in enumerate(parts):
        run += p
        if run >= size or i == len(parts) - 1:
            groups, run = groups + 1, 0
    return groups


def stage3(numels: list[int], o: ZeroOptions, world: int, elem: int, optimizer: str,
           momentum: float) -> list[RankBytes]:
    parts = [math.ceil(n / world) for n in numels]
    local = sum(parts)
    gathered = sum(p * world for p, keep in zip(parts, persistent(numels, o), strict=True) if keep)
    master = MASTER * local
    state = optimizer_state(local, optimizer, momentum, sub_groups(parts, o.sub_group_size))
    grads = local * elem  # grad_partitions_flat_buffer
    host = 0
    if o.offload_optimizer:
        host += master + state + grads + MASTER * local
        grads += MASTER * local  # the fp32 master parts' .grad
    if o.offload_param:
        host += local * elem  # the parts; persistent tensors stay gathered on the device
    bucket = o.reduce_bucket_size * elem if o.contiguous_gradients else 0
    rank = {"param_bytes": local * elem + gathered * elem, "grad_bytes": grads,
            "optim_bytes": master + state, "master_bytes": master, "buffer_bytes": bucket,
            "host_bytes": host, "host_buffer_bytes": 0, "backward_buffer_bytes": 0}
    return [dict(rank) for _ in range(world)]  # every rank holds a part of every tensor


def deepspeed_state(numels: list[int], cfg: Config, world: int,
                    device: str = "cpu") -> list[RankBytes]:
    """Per-rank bytes of a `strategy.name=deepspeed` run of `cfg` whose parameters (in the
    optimizer's order) have `numels` elements: param/grad/optim/buffer_bytes as summary.json
    counts them (optim_bytes includes master_bytes, the fp32 master weights). host_bytes and
    host_buffer_bytes: the parts of the state and of the buffers that live in host memory when
    a GPU run offloads (on a CPU run every byte is host memory). backward_buffer_bytes: the
    reduce buckets stages 1 and 2 allocate at the start of each backward pass and free at its
    end (`setup_buckets`: two with overlap_comm), not in buffer_bytes."""
    o = zero_options(cfg, world, device)
    t = cfg.train
    elem = ELEM[t.precision]
    if o.stage == 3:
        return stage3(numels, o, world, elem, t.optimizer, t.momentum)
    return stage12(numels, o, world, elem, t.optimizer, t.momentum, t.grad_accum_steps)
