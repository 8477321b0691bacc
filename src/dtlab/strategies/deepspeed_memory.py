"""What dtlab knows about DeepSpeed's memory: the one place that reads DeepSpeed's internals.

Two halves. `held_bytes` measures a live engine (summary.json's memory_per_rank for deepspeed
runs). The second half models the per-rank layout for `dtlab estimate`, which measures torch's
wrappers under the fake backend but cannot do so for DeepSpeed: the estimate must answer without
the optional package, and what it reports for a GPU run (offload's host/device split, the buckets
each backward allocates) is not what a host-only engine shows; DeepSpeed also keeps its world
group in module globals, so one process cannot play rank after rank. Both halves follow
deepspeed 0.19.8 (runtime/zero/stage_1_and_2.py, stage3.py, parameter_offload.py; the names are
theirs), and tests/test_estimate.py checks the model against real engines, to the byte.

A live engine's bytes, by kind:

metrics.state_bytes sees `model.parameters()` and `optimizer.state`; DeepSpeed keeps most of its
memory elsewhere: flat fp32 master partitions, gradient partitions and accumulation buffers,
communication buckets. This walks every tensor reachable from the engine's ZeRO optimizer object
(its attributes, lists, dicts and DeepSpeed-owned objects) and counts each storage once:

- param_bytes: the module's parameters as they are held (ZeRO 3: this rank's partitions
  `ds_tensor`, plus the small parameters ZeRO 3 keeps whole, below
  stage3_param_persistence_threshold) and whatever aliases them (DeepSpeed's flat groups).
- grad_bytes: parameter gradients and DeepSpeed's gradient partitions/accumulators, including the
  `.grad` of the fp32 master partitions under offload.
- optim_bytes: the optimizer state (exp_avg, ...) plus the fp32 master weights. In fp32 training
  DeepSpeed still keeps its own fp32 copy of this rank's partition.
- buffer_bytes: everything else: reduction/all-gather buckets (sized by reduce_bucket_size and
  friends; allocated, on CPU not necessarily touched), offload staging buffers, scalars.
A storage is counted at its full size even when only a view of it is in use.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtlab.config.strategies.deepspeed_config import NVME_PARAM_BUFFERS
from dtlab.config.strategies.spec import Config
from dtlab.errors import DtlabError
from dtlab.strategies.deepspeed_swap import MIN_AIO_BYTES, SwapOptions, swap_bytes

MASTER = {"single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_partitioned_groups"}
GRADS = {"averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer",
         "accumulated_grads_in_cpu", "fp32_groups_gradients", "fp32_groups_gradients_flat"}
PARAMS = {"bit16_groups", "bit16_groups_flat", "parallel_partitioned_bit16_groups", "fp16_groups",
          "fp16_partitioned_groups", "fp16_partitioned_groups_flat"}
KINDS = ("param_bytes", "grad_bytes", "optim_bytes", "buffer_bytes")


def _tensors(value: Any, seen: set[int], depth: int = 0) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is_a_grad) for every tensor reachable from value."""
    if id(value) in seen or depth > 8:
        return
    seen.add(id(value))
    if torch.is_tensor(value):
        if value.device.type == "meta":  # shape records, no memory
            return
        yield value, False
        if value.grad is not None:
            yield value.grad, True
        if hasattr(value, "ds_tensor"):  # a ZeRO 3 parameter: its partition
            yield from _tensors(value.ds_tensor, seen, depth + 1)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _tensors(v, seen, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, seen, depth + 1)
    elif type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
        for v in vars(value).values():
            yield from _tensors(v, seen, depth + 1)


def held_storages(engine: Any) -> list[tuple[str, str, int]]:
    """(kind, where it was found, bytes) for each storage, counted once."""
    counted: set[tuple[int, int]] = set()
    out: list[tuple[str, str, int]] = []

    def add(tensor: torch.Tensor, kind: str, where: str) -> None:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() and key not in counted:  # the first, most specific, kind wins
            counted.add(key)
            out.append((kind, where, storage.nbytes()))

    seen: set[int] = set()
    for p in engine.module.parameters():
        for t, is_grad in _tensors(p, seen):
            add(t, "grad_bytes" if is_grad else "param_bytes", "module")
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        for t, _ in _tensors(list(inner.state.values()), seen):
            add(t, "optim_bytes", "optimizer.state")
    known = MASTER | GRADS | PARAMS  # named buffers first: an alias elsewhere is not a buffer
    for attr, value in sorted(vars(opt).items(), key=lambda item: item[0] not in known):
        for t, is_grad in _tensors(value, seen):
            kind = ("grad_bytes" if is_grad or attr in GRADS else "optim_bytes" if attr in MASTER
                    else "param_bytes" if attr in PARAMS else "buffer_bytes")
            add(t, kind, attr + (".grad" if is_grad else ""))
    return out


def held_bytes(engine: Any) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for kind, _, nbytes in held_storages(engine):
        out[kind] += nbytes
    return out


# ---------------------------------------------------------------- the layout, modelled
# Stages 1 and 2 (DeepSpeedZeroOptimizer): one flat buffer padded to 2n
# (nccl_start_alignment_factor x n), rank r's slice of it in fp32 master and optimizer state, the
# whole gradient of every tensor touching the slice (get_partition_info, get_flat_partition), and
# under offload an fp32 `.grad` of the slice, a working-dtype copy and two staging buffers; reduce
# buckets only during backward (setup_buckets). Stage 3 (DeepSpeedZeroOptimizer_Stage3): part r
# of every tensor, small tensors kept gathered (mark_persistent_parameters), gradients in
# grad_partitions_flat_buffer, state per sub group (_create_fp16_sub_groups), the reduce bucket
# allocated at init. Scalars (norms, flags: under 1 KiB) are not counted; knobs that change the
# layout and are not modelled raise DtlabError.
RankBytes = dict[str, int]
MASTER_ELEM = 4  # fp32 master weights and gradients of the optimizer
# zero_optimization keys that change the layout, with the only value modelled (0.19.8's default;
# cpu_offload and cpu_offload_params are deprecated spellings of the offload sections)
UNMODELLED = {"round_robin_gradients": False, "parameter_alignment": False,
              "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
              "zero_quantized_gradients": False, "cpu_offload": False, "cpu_offload_params": False}


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
    swap: SwapOptions = SwapOptions()  # NVMe offload (deepspeed_swap.py)


def zero_options(cfg: Config, world: int, device: str = "cpu") -> ZeroOptions:
    """The options a run of `cfg` gives DeepSpeed (dtlab's own config mapping, JSON included)."""
    from dtlab.config.strategies.deepspeed_config import deepspeed_config

    ds = deepspeed_config(cfg, world, device)
    zero = ds["zero_optimization"]
    for key, default in UNMODELLED.items():
        if zero.get(key) not in (None, default):
            raise DtlabError(f"zero_optimization.{key}={json.dumps(zero[key])}: no exact layout "
                             f"for it; fix: remove it from the DeepSpeed JSON to estimate (only "
                             f"{json.dumps(default)} is modelled)")
    for key, value in (("data_types.grad_accum_dtype", (ds.get("data_types") or {}).get(
            "grad_accum_dtype")), ("communication_data_type", ds.get("communication_data_type"))):
        if value not in (None, cfg.train.precision):
            raise DtlabError(f"{key} other than the working dtype has no exact layout; fix: "
                             "remove it from the DeepSpeed JSON to estimate")
    offloaded, nvme = {}, {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        offloaded[key] = section.get("device", "none") not in (None, "none")
        if section.get("device") == "nvme":
            nvme[key] = section
    aio, param = ds.get("aio") or {}, nvme.get("offload_param", {})
    swap = SwapOptions(
        params="offload_param" in nvme, optimizer="offload_optimizer" in nvme,
        param_buffer_count=int(param.get("buffer_count", 5)),  # DeepSpeed's defaults
        param_buffer_size=int(param.get("buffer_size", 100_000_000)),
        optimizer_buffer_count=int(nvme.get("offload_optimizer", {}).get("buffer_count", 4)),
        block_size=int(aio.get("block_size", MIN_AIO_BYTES)),
        intra_op_parallelism=int(aio.get("intra_op_parallelism", 1)))

    def get(default: Any, *names: str) -> Any:  # the first name set, else the default
        return next((zero[n] for n in names if zero.get(n) is not None), default)

    return ZeroOptions(
        zero["stage"], **offloaded,
        reduce_bucket_size=int(get(500_000_000, "reduce_bucket_size")),
        contiguous_gradients=bool(get(True, "contiguous_gradients")),
        overlap_comm=bool(get(zero["stage"] == 3, "overlap_comm")),
        persistence_threshold=int(get(100_000, "param_persistence_threshold",
                                      "stage3_param_persistence_threshold")),
        model_persistence_threshold=int(get(2**63 - 1, "model_persistence_threshold",
                                            "stage3_model_persistence_threshold")),
        sub_group_size=int(get(1_000_000_000, "sub_group_size")), swap=swap)


def optimizer_state(numel: int, optimizer: str, momentum: float, flats: int = 1) -> int:
    """fp32 state of `flats` flat tensors holding `numel` elements in all."""
    if optimizer == "adamw":  # exp_avg, exp_avg_sq, and one 4-byte `step` per flat tensor
        return 2 * 4 * numel + 4 * flats
    return 4 * numel if momentum > 0 else 0  # SGD's momentum buffer


# --------------------------------------------------------------------------------- stages 1, 2
def slice_grad_elements(numels: list[int], part: int, rank: int) -> tuple[int, int]:
    """(elements of the whole tensors touching rank's slice of the flat buffer, zero padding):
    a tensor belongs to the slice it starts in, and also to the slice it runs into."""
    lo, hi = rank * part, (rank + 1) * part
    whole = covered = offset = 0
    for n in numels:
        if n and (lo <= offset < hi or offset < lo < offset + n):
            whole += n
            covered += min(offset + n, hi) - max(offset, lo)
        offset += n
    return (whole, part - covered) if whole else (0, part)  # all padding: one zero tensor


def stage12(numels: list[int], o: ZeroOptions, world: int, elem: int, optimizer: str,
            momentum: float, accum_steps: int) -> list[RankBytes]:
    total, largest = sum(numels), max(numels, default=0)
    flat = math.ceil(total / (2 * world)) * 2 * world
    part = flat // world
    bucket = o.reduce_bucket_size * elem * (2 if o.overlap_comm else 1) if o.contiguous_gradients else 0
    accumulating = accum_steps > 1
    out = []
    for rank in range(world):
        whole, pad = slice_grad_elements(numels, part, rank)
        master, state = MASTER_ELEM * part, optimizer_state(part, optimizer, momentum)
        grads, buffers, host, host_buffers = (whole + pad) * elem, 0, 0, 0
        if o.offload_optimizer:
            grads = MASTER_ELEM * part  # the master slice's fp32 .grad
            host_buffers = part * elem + largest * elem  # the slice in the working dtype, staging
            buffers = host_buffers + largest * elem  # + the device-side staging buffer
            host = master + state + grads
            if accumulating and o.stage == 2:  # per-tensor accumulators in host memory
                grads, host = grads + whole * elem, host + whole * elem
        if accumulating and o.stage == 1:  # every gradient whole until the boundary reduces
            grads = grads + total * elem if o.offload_optimizer else max(grads, total * elem)
            buffers += bucket
        out.append({"param_bytes": flat * elem, "grad_bytes": grads,
                    "optim_bytes": master + state, "master_bytes": master,
                    "buffer_bytes": buffers, "host_bytes": host, "host_buffer_bytes": host_buffers,
                    "backward_buffer_bytes": 0 if accumulating and o.stage == 1 else bucket})
    return out


# ------------------------------------------------------------------------------------ stage 3
def persistent(numels: list[int], o: ZeroOptions) -> list[bool]:
    """Small tensors, in the module's order, until the model-wide budget is spent."""
    out, kept = [], 0
    for n in numels:
        out.append(n + kept <= o.model_persistence_threshold and n <= o.persistence_threshold)
        kept += n if out[-1] else 0
    return out


def sub_groups(parts: list[int], size: int) -> list[list[int]]:
    """The tensors (indices) of each optimizer sub group: consecutive tensors until `size`
    partition elements make a group."""
    if size >= sum(parts):
        return [list(range(len(parts)))]
    groups, run = [[]], 0
    for i, p in enumerate(parts):
        groups[-1].append(i)
        run += p
        if (run >= size or i == len(parts) - 1) and groups[-1]:
            groups, run = [*groups, []], 0
    return [g for g in groups if g]


def stage3(numels: list[int], o: ZeroOptions, world: int, elem: int, optimizer: str,
           momentum: float) -> list[RankBytes]:
    parts = [math.ceil(n / world) for n in numels]
    local = sum(parts)
    gathered = sum(p * world for p, keep in zip(parts, persistent(numels, o), strict=True) if keep)
    master, groups = MASTER_ELEM * local, sub_groups(parts, o.sub_group_size)
    state = optimizer_state(local, optimizer, momentum, len(groups))
    grads, host = local * elem, 0  # grad_partitions_flat_buffer
    if o.offload_optimizer:
        host += master + state + grads + MASTER_ELEM * local
        grads += MASTER_ELEM * local  # the fp32 master parts' .grad
    if o.offload_param:
        host += local * elem  # the parts; persistent tensors stay gathered on the device
    rank = {"param_bytes": (local + gathered) * elem, "grad_bytes": grads,
            "optim_bytes": master + state, "master_bytes": master,
            "buffer_bytes": o.reduce_bucket_size * elem if o.contiguous_gradients else 0,
            "host_bytes": host, "host_buffer_bytes": 0, "backward_buffer_bytes": 0}
    if o.swap.params or o.swap.optimizer:  # NVMe: part of the host's share goes to disk
        states = 2 if optimizer == "adamw" else int(momentum > 0)
        sw = o.swap  # dtlab's default buffer grows to the largest partition (deepspeed_nvme.py)
        if sw.params and sw.param_buffer_size == NVME_PARAM_BUFFERS["buffer_size"]:
            sw = replace(sw, param_buffer_size=max(sw.param_buffer_size, *parts))
        swap = swap_bytes(parts, persistent(numels, o), groups, elem, states, sw)
        rank.update(disk_bytes=swap["disk"], swapped_bytes=swap["moved"],
                    host_bytes=host - swap["moved"],
                    host_buffer_bytes=swap["buffers"],
                    buffer_bytes=rank["buffer_bytes"] + swap["buffers"])
    return [{**rank, "rank": r} for r in range(world)]  # every rank holds a part of every tensor


SOURCE = "modelled (DeepSpeed 0.19.8 layout)"


def modelled_state(numels: list[int], cfg: Config, world: int,
                   device: str = "cpu") -> list[RankBytes]:
    """Per-rank bytes of a `strategy.name=deepspeed` run of `cfg` whose parameters (in the
    optimizer's order) have `numels` elements, as summary.json counts them (optim_bytes includes
    master_bytes, the fp32 master weights); host_bytes and host_buffer_bytes: what a GPU run's
    offload keeps in host memory; backward_buffer_bytes: the reduce buckets of each backward."""
    o, t = zero_options(cfg, world, device), cfg.train
    elem = {"fp32": 4, "bf16": 2, "fp16": 2}[t.precision]
    if o.stage == 3:
        return stage3(numels, o, world, elem, t.optimizer, t.momentum)
    out = stage12(numels, o, world, elem, t.optimizer, t.momentum, t.grad_accum_steps)
    return [{**r, "rank": i} for i, r in enumerate(out)]
