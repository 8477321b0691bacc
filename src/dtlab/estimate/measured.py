"""Per-rank training state of dtlab's torch strategies, measured under PyTorch's fake backend.

One rank at a time, in this process: a fake process group for that rank and world size (every
collective returns at once and moves no data), the config's model built on the meta device and
materialised uninitialised on the host (`to_empty`), wrapped by dtlab's own strategy class, one
forward, backward and optimizer step on a small batch, then the strategy's own `state_bytes`: the
numbers summary.json's `memory_per_rank` holds after a real run. The values are garbage (nothing
was initialised or communicated), but the shapes, shards, paddings and storages are the real
wrappers' own, and bytes depend on nothing else. Limits: the whole model is held once on the host
and run forward and backward (MAX_PARAMS); gradients are counted as a host run lays them out.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.config import Config, data_parallel_size, model_parallel_size
from dtlab.data import spec_for
from dtlab.errors import DtlabError
from dtlab.models import build_model

RankBytes = dict[str, int]  # param_bytes, grad_bytes, optim_bytes (+ "rank")
EVERY_RANK = 16  # up to this world size every rank is measured (the tests compare per rank)
MAX_PARAMS = 50_000_000  # a few seconds and a few hundred MB per measured rank on a CPU


def measured_strategies() -> tuple[str, ...]:
    """dtlab's strategies measured here: torch's own wrappers, which run on the fake backend.
    (DeepSpeed has its own model: deepspeed_model.py.) The one list of names, for a registry."""
    return ("single", "ddp", "fsdp", "fsdp1", "zero1", "tp", "fsdp_tp", "pp")


def meta_model(cfg: Config) -> nn.Module:
    """The config's model with its exact parameter shapes, no memory allocated."""
    with torch.device("meta"):
        return build_model(cfg.model, spec_for(cfg))


@contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of `world` on the fake backend; the group is always destroyed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():  # a real group (a training process): never replace or destroy it
        raise DtlabError("a process group is already initialised in this process; fix: run "
                         "dtlab estimate in a process of its own")
    hook = sys.excepthook  # init_process_group wraps it, for good: 1,024 groups, 1,024 wraps
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():  # FSDP1's deprecation, DTensor's notes: once per rank
            warnings.simplefilter("ignore")
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        if "torch.distributed.tensor" in sys.modules:
            # DTensor caches sharding decisions by mesh layout, meshes and all: the next rank's
            # equal-looking mesh would get this one's destroyed groups
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()


def measure_rank(cfg: Config, rank: int, world: int, ranks_per_node: int,
                 device: torch.device) -> tuple[RankBytes, list[tuple[int, int]] | None]:
    """This rank's bytes, and what every rank holds where the instance tells (see `shares`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    from dtlab.distributed import DistContext, DistEnv
    from dtlab.estimate.measure import batch
    from dtlab.strategies import strategy_class

    env = DistEnv(rank, rank % ranks_per_node, world, ranks_per_node, launcher="env")
    with fake_group(rank, world):
        ctx = DistContext(env, device, "fake", torch.get_num_threads())
        strategy = strategy_class(cfg.strategy.name)(cfg, ctx)
        model = strategy.wrap(meta_model(cfg).to_empty(device=device))
        # DDP's reducer expects its all-reduce's future to hold the bucket, and the fake one
        # holds nothing: a hook returning the bucket itself (pp's replicas are its `parts`).
        for m in (model, *getattr(strategy, "parts", ())):
            if isinstance(m, DistributedDataParallel):
                m.register_comm_hook(None, noop_hook)
        optimizer = strategy.build_optimizer(model)
        micro = cfg.train.global_batch_size // (data_parallel_size(cfg, world)
                                                 * cfg.train.grad_accum_steps)
        x, y = batch(cfg.model.name, spec_for(cfg), micro, device)
        if hasattr(strategy, "stage_ids"):  # pp: see `stages_forward_backward`
            stages_forward_backward(strategy, device)
        else:
            strategy.forward_backward(model, x, y, lambda loss: (loss, loss))
        strategy.optimizer_step(optimizer)
        held = strategy.state_bytes(model, optimizer)
        return {**held, "rank": rank}, shares(model, optimizer, world)


def stages_forward_backward(pp: Any, device: torch.device) -> None:
    """Each of this rank's pipeline stages forward and backward on its own, on inputs of the
    shapes the stage is declared with. Not the schedule: its first step agrees on a mode and
    exchanges shape records point to point (recv_object_list), which a fake group cannot deliver.
    The gradients are the same tensors either way: each parameter's, or FSDP's / DDP's buckets."""
    for part, stage in zip(pp.parts, pp.stage_ids, strict=True):
        meta = pp._shapes(stage)["input_args"]
        x = torch.zeros(meta.shape, dtype=meta.dtype, device=device,
                        requires_grad=meta.requires_grad)
        with pp.autocast():
            out = part(x)
        out.float().sum().backward()


def shares(model: nn.Module, optimizer: Any, world: int) -> list[tuple[int, int]] | None:
    """(elements, tensors) of optimizer state each rank holds, read from this rank's instance
    where torch keeps every rank's share: ZeroRedundancyOptimizer's partition of whole tensors,
    FSDP1's FlatParameters (the same padded layout on every rank; rank r holds the r-th 1/s).
    None where every rank's share follows from the mesh alone (see `ranks_to_measure`)."""
    if hasattr(optimizer, "_partition_parameters"):  # torch's ZeroRedundancyOptimizer
        return [(sum(p.numel() for g in groups for p in g["params"]),
                 sum(len(g["params"]) for g in groups))
                for groups in optimizer._partition_parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel

    handles = [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle]
    if not handles or not handles[0].uses_sharded_strategy:
        return None
    out = [(0, 0)] * world
    for h in handles:
        flat, shards = h.flat_param, h.world_size  # world, or HYBRID_SHARD's group
        size, start = flat._sharded_size.numel(), 0
        for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
            for r in range(world):  # HYBRID: mesh (replicate, shard), rank r is shard r % s
                lo = (r % shards) * size
                held = min(start + numel, lo + size) - max(start, lo)
                if held > 0 and not padding:
                    out[r] = (out[r][0] + held, out[r][1] + 1)
            start += numel
    return out


def ranks_to_measure(cfg: Config, world: int, first: list[tuple[int, int]] | None) -> list[int]:
    """Ranks that, with rank 0, provably include one holding the most of every kind.

    With `first` (every rank's (elements, tensors), from rank 0's instance): the ranks no other
    rank matches or exceeds in both. Each kind of bytes grows with both (elementwise optimizer
    state, one `step` per tensor; FSDP1 holds its shard's storage only if some parameter has an
    element in it), so every kind's maximum is among them. Without it: the rest are replicas
    (ddp, NO_SHARD), or shard with torch.chunk semantics (FSDP2, DTensor for tp), where the
    rank at coordinate 0 of a mesh dimension holds ceil(d / n) rows of every tensor and no rank
    holds more; pp's ranks hold different stages: the first replica's (coordinate 0 on dp).
    """
    chosen = {0}
    if first is not None:
        best = -1
        for r in sorted(range(world), key=lambda r: (-first[r][0], -first[r][1], r)):
            if first[r][1] > best:
                chosen.add(r)
                best = first[r][1]
    elif cfg.strategy.name == "pp":
        chosen |= set(range(model_parallel_size(cfg, world)))  # mesh (dp, pp), row-major
    return sorted(chosen)


def measuring_config(cfg: Config, world: int) -> Config:
    """`cfg` with what does not change the state bytes set so that any world size runs: one
    sample per rank (pp: one per microbatch), and DDP's communication hooks off (they change
    what travels, not what is held; DDP takes one hook, and the measurement needs its own)."""
    if cfg.strategy.zero1.overlap_with_ddp and cfg.strategy.name == "zero1":
        raise NotMeasured("strategy.zero1.overlap_with_ddp steps inside DDP's NCCL hook")
    t = cfg.train
    per_rank = cfg.strategy.pp.microbatches if cfg.strategy.name == "pp" else 1
    batch = data_parallel_size(cfg, world) * t.grad_accum_steps * per_rank
    return cfg.model_copy(update={
        "train": t.model_copy(update={"global_batch_size": batch}),
        "strategy": cfg.strategy.model_copy(update={
            "ddp": cfg.strategy.ddp.model_copy(update={"comm_hook": "none"})}),
    })


def measure(cfg: Config, world: int, ranks_per_node: int, device: str = "cpu",
            every_rank: bool = False) -> list[RankBytes]:
    """Measured bytes of the ranks `ranks_to_measure` picks (every rank up to EVERY_RANK)."""
    n = sum(p.numel() for p in {id(p): p for p in meta_model(cfg).parameters()}.values())
    if n > MAX_PARAMS:
        raise NotMeasured(f"{n:,} parameters, more than the {MAX_PARAMS:,} measured here in "
                          "seconds (the whole model runs once on the host)")
    cfg = measuring_config(cfg, world)
    dev = torch.device(device)
    try:
        first, every = measure_rank(cfg, 0, world, ranks_per_node, dev)
        ranks = (range(world) if every_rank or world <= EVERY_RANK
                 else ranks_to_measure(cfg, world, every))
        return [first] + [measure_rank(cfg, r, world, ranks_per_node, dev)[0] for r in ranks if r]
    except DtlabError as e:  # what the strategy refuses here (FSDP1 offload without a GPU)
        raise NotMeasured(str(e)) from None


class NotMeasured(DtlabError):
    """This setup cannot be measured here; the estimate falls back to the modelled layout."""

