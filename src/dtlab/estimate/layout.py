"""Exact per-rank bytes of parameters, gradients and optimizer state of a real dtlab model.

The same quantities `summary.json` measures (`memory_per_rank`: param_bytes, grad_bytes,
optim_bytes, from dtlab/metrics.py state_bytes) at the end of a run, after the last optimizer step
(gradients are still allocated: they are set to None at the start of the next step). Computed from
the model built on the meta device and the layout rules of each wrapper in the installed torch:

- replicated (single, ddp, zero1): every parameter whole. DDP's gradients are views into its
  buckets, which hold exactly the parameters' elements. zero1 (torch ZeroRedundancyOptimizer)
  keeps optimizer state only for the whole tensors assigned to this rank: largest first, each to
  the rank with the fewest elements so far.
- fsdp (FSDP2 fully_shard): each parameter is chunked on dim 0 into ceil(d0/n) rows per rank and
  each rank's chunk is padded to that many rows (its own storage). The gradients of one
  fully_shard unit are views into one reduce-scatter output of the padded size. The optimizer
  state is created at the unpadded local shapes (the last ranks may hold fewer rows, or none).
- fsdp1 (FullyShardedDataParallel, use_orig_params=True): each wrapped unit's parameters become
  one FlatParameter: every tensor starts at a 16-byte-aligned offset, and the total is padded to a
  multiple of the shard count; each rank holds one contiguous 1/s of it. A rank's original
  parameters are views into its shard; those with no element in it have no gradient and no
  optimizer state.
- deepspeed (ZeRO 1/2/3): deepspeed_layout.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.config import Config
from dtlab.data import spec_for
from dtlab.errors import DtlabError
from dtlab.models import build_model

RankBytes = dict[str, int]  # param_bytes, grad_bytes, optim_bytes


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    elem: int  # bytes per element

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def meta_model(cfg: Config) -> nn.Module:
    """The config's model with its exact parameter shapes, no memory allocated."""
    with torch.device("meta"):
        return build_model(cfg.model, spec_for(cfg))


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())  # tied weights count once


def as_tensors(params: list[nn.Parameter]) -> list[Tensor]:
    return [Tensor(tuple(p.shape), p.element_size()) for p in params]


def optim_bytes(numel: int, optimizer: str, momentum: float) -> int:
    """Optimizer state of one parameter with `numel` local elements (fp32 states)."""
    if optimizer == "adamw":  # exp_avg, exp_avg_sq, and `step`: a 0-dim fp32 tensor
        return 2 * 4 * numel + 4
    return 4 * numel if momentum > 0 else 0  # SGD's momentum buffer


# ------------------------------------------------------------------------------ replicated
def replicated(tensors: list[Tensor], optimizer: str, momentum: float, world: int) -> list[RankBytes]:
    params = sum(t.numel * t.elem for t in tensors)
    optim = sum(optim_bytes(t.numel, optimizer, momentum) for t in tensors)
    return [{"param_bytes": params, "grad_bytes": params, "optim_bytes": optim}] * world


def zero1_partition(numels: list[int], world: int) -> list[list[int]]:
    """Indices per rank, as torch's ZeroRedundancyOptimizer assigns whole tensors (one group)."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)  # stable
    sizes, ranks = [0] * world, [[] for _ in range(world)]
    for i in order:
        r = sizes.index(min(sizes))
        ranks[r].append(i)
        sizes[r] += numels[i]
    return ranks


def zero1(tensors: list[Tensor], optimizer: str, momentum: float, world: int) -> list[RankBytes]:
    full = replicated(tensors, optimizer, momentum, 1)[0]
    return [{**full, "optim_bytes": sum(optim_bytes(tensors[i].numel, optimizer, momentum)
                                        for i in mine)}
            for mine in zero1_partition([t.numel for t in tensors], world)]


# ----------------------------------------------------------------------------------- FSDP2
def fsdp2(units: list[list[Tensor]], optimizer: str, momentum: float, world: int,
          grads_copied: bool = False) -> list[RankBytes]:
    """`units`: the parameters of each fully_shard call. `grads_copied`: CPU offload from a GPU,
    where each gradient shard is copied to the host at its unpadded size."""
    out = []
    for rank in range(world):
        params = grads = optim = 0
        for unit in units:
            for t in unit:
                rows, rest = t.shape[0], math.prod(t.shape[1:])
                chunk = math.ceil(rows / world)
                local = max(0, min(chunk, rows - rank * chunk)) * rest
                params += chunk * rest * t.elem
                grads += (local if grads_copied else chunk * rest) * t.elem
                optim += optim_bytes(local, optimizer, momentum)
        out.append({"param_bytes": params, "grad_bytes": grads, "optim_bytes": optim})
    return out


def fsdp2_units(model: nn.Module, root: bool = True) -> list[list[Tensor]]:
    """One unit per block, then (`root`) the root with the parameters no block holds."""
    units, taken = [], set()
    for block in model.blocks():
        params = [p for p in unique_params(block) if id(p) not in taken]
        taken |= {id(p) for p in params}
        units.append(as_tensors(params))
    if root:
        units.append(as_tensors([p for p in unique_params(model) if id(p) not in taken]))
    return [u for u in units if u]


# ----------------------------------------------------------------------------------- FSDP1
def flat_layout(unit: list[Tensor], shards: int, align: int) -> tuple[list[int], int]:
    """Offsets of each tensor in the FlatParameter and its padded total (elements). `align`:
    elements per 16 bytes of the dtype forward and backward run in (4 for fp32, 8 for bf16)."""
    offsets, total = [], 0
    for t in unit:
        if total % align:
            total += align - total % align
        offsets.append(total)
        total += t.numel
    if total % shards:
        total += shards - total % shards
    return offsets, total


def fsdp1(units: list[list[Tensor]], optimizer: str, momentum: float, world: int,
          shards: int, sharded: bool = True, compute_elem: int = 4) -> list[RankBytes]:
    """`shards`: ranks one FlatParameter is divided over (world, or the HYBRID_SHARD group);
    `sharded=False` is NO_SHARD (padded the same way, held whole); `compute_elem`: bytes per
    element of the dtype forward runs in (MixedPrecision's param_dtype)."""
    out = []
    for rank in range(world):
        params = grads = optim = 0
        for unit in units:
            offsets, total = flat_layout(unit, shards, 16 // compute_elem)
            elem = unit[0].elem
            if not sharded:
                params += total * elem
                grads += total * elem
                optim += sum(optim_bytes(t.numel, optimizer, momentum) for t in unit)
                continue
            size = total // shards
            lo = (rank % shards) * size
            overlaps = [max(0, min(off + t.numel, lo + size) - max(off, lo))
                        for off, t in zip(offsets, unit, strict=True)]
            if any(overlaps):  # some parameter is a view into this rank's shard
                params += size * elem
                grads += size * elem
            optim += sum(optim_bytes(k, optimizer, momentum) for k in overlaps if k)
        out.append({"param_bytes": params, "grad_bytes": grads, "optim_bytes": optim})
    return out


def fsdp1_units(model: nn.Module, auto_wrap: str, min_num_params: int) -> list[list[Tensor]]:
    """The FlatParameters FSDP1 builds: each wrapped module's parameters that no wrapped
    descendant took, in FSDP's flattening order (named_modules, then each module's own)."""
    targets = wrapped_modules(model, auto_wrap, min_num_params) + [model]
    taken: set[int] = set()
    units = []
    for unit in targets:  # post-order: children take their parameters first
        own = [p for p in unique_params(unit) if id(p) not in taken]
        own_ids = {id(p) for p in own}
        ordered, seen = [], set()
        for sub in unit.modules():
            for p in sub.parameters(recurse=False):
                if id(p) in own_ids and id(p) not in seen:
                    seen.add(id(p))
                    ordered.append(p)
        taken |= own_ids
        if ordered:
            units.append(as_tensors(ordered))
    return units


def wrapped_modules(model: nn.Module, auto_wrap: str, min_num_params: int) -> list[nn.Module]:
    """The modules FSDP1's auto-wrap policy wraps (not the root), in post-order. Uses torch's own
    policy code, so the choice is exactly FSDP1's."""
    from torch.distributed.fsdp.wrap import (
        ModuleWrapPolicy,
        _recursive_wrap,
        size_based_auto_wrap_policy,
    )

    if auto_wrap == "none":
        return []
    if auto_wrap == "block":
        policy = ModuleWrapPolicy({type(b) for b in model.blocks()})
        chosen = set(policy._run_policy(model, set(), {}))
        return [m for m in post_order(model) if m in chosen and m is not model]
    recorded: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        recorded.append(module)
        return module  # not wrapped: the meta model only tells which modules would be

    policy_fn = lambda module, recurse, nonwrapped_numel: size_based_auto_wrap_policy(  # noqa: E731
        module, recurse, nonwrapped_numel, min_num_params=min_num_params)
    _recursive_wrap(model, policy_fn, record, set(), set(), only_wrap_children=True)
    return recorded


def post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out += post_order(child)
    return [*out, module]


# ---------------------------------------------------------------------------------- a config
def layout_kind(cfg: Config) -> str:
    """The ideal layout (memory.KINDS) a dtlab strategy corresponds to."""
    s = cfg.strategy
    if s.name == "fsdp":
        return "zero3" if s.fsdp.reshard_after_forward else "zero2"
    if s.name == "fsdp1":
        return {"FULL_SHARD": "zero3", "HYBRID_SHARD": "zero3", "SHARD_GRAD_OP": "zero2",
                "NO_SHARD": "ddp"}[s.fsdp1.sharding_strategy]
    if s.name == "zero1":
        return "zero1"
    if s.name == "deepspeed":
        from dtlab.estimate.deepspeed_layout import zero_stage

        return f"zero{zero_stage(cfg)}"
    return "ddp"


def exact_state(cfg: Config, world: int, ranks_per_node: int | None = None,
                device: str = "cpu") -> list[RankBytes]:
    """Per-rank param/grad/optim bytes of `cfg`'s model under `cfg`'s strategy on `world` ranks."""
    model = meta_model(cfg)
    t, s = cfg.train, cfg.strategy
    opt, mom = t.optimizer, t.momentum
    if s.name == "fsdp":
        return fsdp2(fsdp2_units(model), opt, mom, world,
                     grads_copied=s.fsdp.cpu_offload and device == "cuda")
    if s.name == "fsdp1":
        o = s.fsdp1
        units = fsdp1_units(model, o.auto_wrap, o.min_num_params)
        shards = world
        if o.sharding_strategy == "HYBRID_SHARD":
            shards = o.shard_group_size or ranks_per_node or world
        return fsdp1(units, opt, mom, world, shards, sharded=o.sharding_strategy != "NO_SHARD",
                     compute_elem=4 if t.precision == "fp32" else 2)
    tensors = as_tensors(unique_params(model))
    if s.name == "deepspeed":
        from dtlab.estimate.deepspeed_layout import deepspeed_state

        return deepspeed_state([t.numel for t in tensors], cfg, world, device)
    if s.name == "zero1":
        return zero1(tensors, opt, mom, world)
    if s.name in ("single", "ddp"):
        return replicated(tensors, opt, mom, world)
    raise DtlabError(f"no exact layout for strategy '{s.name}' yet; fix: estimate its ideal "
                     "layout instead (zero1, zero2, zero3)")
