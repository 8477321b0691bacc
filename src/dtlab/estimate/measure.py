"""The per-rank state of dtlab's torch strategies, measured under PyTorch's fake backend.

The state, one rank at a time in this process: a fake process group for that rank (collectives
return at once and move nothing), the config's model built on the meta device and materialised,
not initialised, on the host, wrapped by dtlab's own strategy class, one forward, backward and
optimizer step, then the strategy's own `state_bytes`, what summary.json's memory_per_rank holds
after a real run. Values are garbage; shapes, shards, paddings and storages are the wrappers' own,
and bytes depend on nothing else. Limits: the whole model is held once on the host and run
(MAX_PARAMS), on up to MAX_WORLD ranks; offload is measured as on a host-only run.
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

from dtlab.config import Config, check_world, data_parallel_size, model_parallel_size
from dtlab.data import spec_for
from dtlab.errors import DtlabError
from dtlab.models import build_model, count_params

RankBytes = dict[str, int]  # param_bytes, grad_bytes, optim_bytes (+ "rank")
EVERY_RANK = 16  # up to this world size every rank is measured (the tests compare per rank)
MAX_PARAMS = 50_000_000  # a few seconds and a few hundred MB per measured rank on a CPU
MAX_WORLD = 4096  # shards are listed per rank: 10^5 FSDP ranks took 45 s and 2 GB here


class NotMeasured(DtlabError):
    """This setup cannot be measured here; the estimate falls back to the ideal layout."""


def meta_model(cfg: Config) -> nn.Module:
    """The config's model with its exact parameter shapes, no memory allocated."""
    with torch.device("meta"):
        return build_model(cfg.model, spec_for(cfg), cfg.train.lora)


@contextmanager
def one_process_group(backend: str, rank: int, world: int, command: str) -> Iterator[None]:
    """This process as `rank` of `world` on a backend that needs no other process (torch's fake
    one, or dtlab predict's recording one): made with a FakeStore, destroyed on every exit path,
    with what making it changes in the process undone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():  # a real group (a training process): never replace or destroy it
        raise DtlabError("a process group is already initialised in this process; fix: run "
                         f"dtlab {command} in a process of its own")
    hook = sys.excepthook  # init_process_group wraps it, for good: 1,024 groups, 1,024 wraps
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():  # FSDP1's deprecation, DTensor's notes: once per rank
            warnings.simplefilter("ignore")
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        if "torch.distributed.tensor" in sys.modules:  # DTensor caches sharding decisions by
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # mesh layout:
            _clear_sharding_prop_cache()  # the next rank's equal-looking mesh would get dead groups


@contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of `world` on the fake backend; the group is always destroyed."""
    # Tiny ops: one thread (two spin against each other on a busy machine, 30x slower here);
    # uninitialised memory holds denormals (200x slower to multiply): flushed to zero meanwhile
    with one_process_group("fake", rank, world, "estimate"):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        try:
            yield
        finally:
            torch.set_flush_denormal(False)  # torch's default; nothing in dtlab sets it
            torch.set_num_threads(threads)


def measure_rank(cfg: Config, rank: int, world: int, ranks_per_node: int,
                 device: torch.device) -> tuple[RankBytes, list[tuple[int, int]] | None]:
    """This rank's bytes, and every rank's share where this instance tells (see `shares`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    from dtlab.distributed import DistContext, DistEnv
    from dtlab.strategies import build

    with fake_group(rank, world):
        env = DistEnv(rank, rank % ranks_per_node, world, ranks_per_node, launcher="env")
        strategy = build(cfg, DistContext(env, device, "fake", 1))
        model, optimizer = strategy.setup(meta_model(cfg).to_empty(device=device))
        # DDP's reducer wants its all-reduce's future to hold the bucket; a fake one holds nothing
        for m in (model, *getattr(strategy, "parts", ())):  # (pp's replicas: `parts`)
            if isinstance(m, DistributedDataParallel) and not m._comm_hooks:  # (or ddp's own)
                m.register_comm_hook(None, noop_hook)
        engine = strategy.step_engine(model, model, optimizer)
        if hasattr(strategy, "stage_ids"):
            stages_forward_backward(strategy, device)
        else:  # one sample: state bytes do not depend on the batch
            x, y = batch(spec_for(cfg), 1, device)
            engine.micro_step(x, y, lambda loss: (loss, loss), sync=True)
        engine.step()
        return {**strategy.state_bytes(model, optimizer), "rank": rank}, shares(model, optimizer)


def stages_forward_backward(pp: Any, device: torch.device) -> None:
    """pp: each of this rank's stages forward and backward, on inputs of the shapes it declares.
    Not the schedule: its first step votes and trades shape records point to point, which a fake
    group cannot deliver. The gradients are the same tensors (each parameter's, FSDP's, DDP's)."""
    for part, stage in zip(pp.parts, pp.stage_ids, strict=True):
        meta = pp._shapes(stage)["input_args"]
        x = torch.zeros(meta.shape, dtype=meta.dtype, device=device, requires_grad=meta.requires_grad)
        with pp.autocast():
            part(x).float().sum().backward()


def shares(model: nn.Module, optimizer: Any) -> list[tuple[int, int]] | None:
    """(elements, tensors) of optimizer state on each rank, where torch keeps every rank's share
    in each instance: ZeroRedundancyOptimizer's partition of whole tensors; FSDP1's
    FlatParameters (the same padded layout on every rank, each holding its 1/s). Else None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if hasattr(optimizer, "_partition_parameters"):  # torch's ZeroRedundancyOptimizer
        return [(sum(p.numel() for g in groups for p in g["params"]),
                 sum(len(g["params"]) for g in groups)) for groups in optimizer._partition_parameters()]
    handles = [m._handle for m in FullyShardedDataParallel.fsdp_modules(model) if m._handle]
    if not handles or not handles[0].uses_sharded_strategy:
        return None
    out = [(0, 0)] * dist.get_world_size()
    for h in handles:
        size, start = h.flat_param._sharded_size.numel(), 0
        for n, pad in zip(h.flat_param._numels_with_padding, h.flat_param._is_padding_mask, strict=True):
            for r in range(len(out)):  # rank r holds shard r % s (HYBRID: mesh (replicate, shard))
                held = min(start + n, (r % h.world_size + 1) * size) - max(start, r % h.world_size * size)
                out[r] = (out[r][0] + held, out[r][1] + 1) if held > 0 and not pad else out[r]
            start += n
    return out


def ranks_to_measure(cfg: Config, world: int, first: list[tuple[int, int]] | None) -> set[int]:
    """Besides rank 0, the ranks that provably include one holding the most of every kind. With
    every rank's (elements, tensors) from rank 0's instance: those no rank matches or exceeds in
    both, since every kind grows with both (elementwise optimizer state, a `step` per tensor;
    FSDP1 counts its shard only if a parameter has an element in it). Else replicas (ddp,
    NO_SHARD) or torch.chunk shards (FSDP2; DTensor for tp): coordinate 0 of a mesh dimension
    holds ceil(d / n) rows of every tensor, no rank more; pp: the first replica's stages."""
    if (mp := model_parallel_size(cfg, world)) > 1:  # mesh (dp, mp), row-major: the first replica
        return set(range(mp))
    chosen, best = {0}, -1
    for r in sorted(range(world), key=lambda r: (-first[r][0], -first[r][1], r)) if first else ():
        if first[r][1] > best:
            chosen.add(r)
            best = first[r][1]
    return chosen


def one_sample_per_rank(cfg: Config, world: int) -> Config:
    """`cfg` with a global batch that any world size splits: one sample per rank and micro step
    (pipelines: one per microbatch). No state byte depends on the batch."""
    t, s = cfg.train, cfg.strategy
    per_rank = getattr(getattr(s, s.name, None), "microbatches", 1)
    return cfg.model_copy(update={"train": t.model_copy(update={
        "global_batch_size": data_parallel_size(cfg, world) * t.grad_accum_steps * per_rank})})


def measure(cfg: Config, world: int, ranks_per_node: int, device: str = "cpu",
            every_rank: bool = False) -> list[RankBytes]:
    """Measured bytes of every rank up to EVERY_RANK, else of those `ranks_to_measure` picks."""
    n = count_params(meta_model(cfg))
    if n > MAX_PARAMS:
        raise NotMeasured(f"{n:,} parameters, more than the {MAX_PARAMS:,} measured in seconds")
    # No DDP communication hook: hooks change what travels, not what is held, and DDP takes one only
    cfg = one_sample_per_rank(cfg, world)
    ddp = cfg.strategy.ddp.model_copy(update={"comm_hook": "none"})
    cfg = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"ddp": ddp})})
    try:
        check_world(cfg, world, ranks_per_node)
        first, every = measure_rank(cfg, 0, world, ranks_per_node, torch.device(device))
        ranks = range(world) if every_rank or world <= EVERY_RANK else ranks_to_measure(cfg, world, every)
        return [first] + [measure_rank(cfg, r, world, ranks_per_node, torch.device(device))[0]
                          for r in sorted(ranks) if r]
    except (DtlabError, RuntimeError, ValueError) as e:  # what the strategy refuses or cannot
        # do on the fake backend here (FSDP1 offload without a GPU, zero1's step in DDP's hook)
        raise NotMeasured(str(e)) from None


def batch(spec: Any, micro: int, device: torch.device | str = "cpu",
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if spec.kind == "tokens":
        x, y = (torch.randint(0, spec.vocab_size, (micro, spec.seq_len), generator=g) for _ in "xy")
    else:
        x = torch.randn(micro, spec.in_channels, spec.image_size, spec.image_size, generator=g)
        y = torch.randint(0, spec.num_classes, (micro,), generator=g)
    return x.to(device), y.to(device)
