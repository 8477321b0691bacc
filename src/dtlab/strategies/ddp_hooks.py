"""DDP communication hooks: what DDP does with each gradient bucket instead of a plain all-reduce.

- fp16: PyTorch's `fp16_compress_hook` (cast to fp16, average, cast back): half the bytes.
- bf16: the same with bfloat16. PyTorch's `bf16_compress_hook` is refused by DDP unless the
  backend is NCCL 2.10+ (or XCCL); `compress_hook` below is backend-neutral (gloo sums bf16 fine).
- powersgd: PyTorch's PowerSGD (per-tensor variant; the batched one failed on CPU here): low-rank
  gradient approximation with error feedback, rank `powersgd_rank`.
- topk: keep the k = ratio x numel largest-magnitude entries of each bucket (plus what earlier
  steps left out: error feedback), all-gather them and average. Not in PyTorch.
- local_sgd: PyTorch's post-local SGD: plain DDP for `local_sgd_warmup` steps, then gradients are
  averaged only inside groups of `local_sgd_group_size` ranks (1: not at all) and parameters over
  all ranks every `local_sgd_period` steps (PeriodicModelAverager, via PostLocalSGDOptimizer).
"""

# No `from __future__ import annotations` here: DDP compares the hooks' annotations with the real
# dist.GradBucket and Future[Tensor] objects and rejects strings.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def compress_hook(dtype: torch.dtype) -> Hook:
    """Average the bucket in `dtype` (any backend that can sum that type)."""

    def hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = group or dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)

    return hook


class TopKState:
    """Per-bucket residuals: what top-k left out, added back before the next selection."""

    def __init__(self, ratio: float, group: dist.ProcessGroup | None = None) -> None:
        self.ratio, self.group = ratio, group or dist.group.WORLD
        self.residuals: dict[int, torch.Tensor] = {}


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    n = dist.get_world_size(state.group)
    residual = state.residuals.get(bucket.index())
    acc = buffer + residual if residual is not None and residual.shape == buffer.shape else buffer.clone()
    k = max(1, int(state.ratio * acc.numel()))
    idx = acc.abs().topk(k, sorted=False).indices
    values = acc[idx]
    acc[idx] = 0  # error feedback: the rest waits for the next step
    state.residuals[bucket.index()] = acc
    all_idx = torch.empty(n * k, dtype=idx.dtype, device=idx.device)
    all_values = torch.empty(n * k, dtype=values.dtype, device=values.device)
    futures = [dist.all_gather_into_tensor(all_idx, idx, group=state.group, async_op=True).get_future(),
               dist.all_gather_into_tensor(all_values, values, group=state.group,
                                           async_op=True).get_future()]

    def scatter(_: Any) -> torch.Tensor:
        buffer.zero_().index_add_(0, all_idx, all_values).div_(n)
        return buffer

    return torch.futures.collect_all(futures).then(scatter)


class BucketNorms:
    """DDP's plain all-reduce with each averaged bucket's squared norm taken as it completes.

    The arithmetic is DDP's built-in one (each bucket divided by the world size, then summed:
    PyTorch's `allreduce_hook`); the squared norm is computed in the all-reduce's completion
    callback, on the thread that completed it while the backward waits for it, on data that
    thread has just written. The loop's non-finite check (nan_policy) then reads one number per
    bucket instead of making a pass of its own over every gradient after the backward: on this
    2-core machine that pass cost ~0.2 ms per step of the quick config's 2-rank DDP step (about
    2%), because it was the first thing to run after the rank woke from the collective.
    """

    def __init__(self) -> None:
        self.squares: dict[int, torch.Tensor] = {}
        self.buckets: int | None = None

    def hook(self, group: dist.ProcessGroup | None,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = group or dist.group.WORLD
        index, buffer = bucket.index(), bucket.buffer()
        if index == 0:  # buckets are launched in order: a new backward's all-reduces begin
            self.squares, self.buckets = {}, None
        if bucket.is_last():
            self.buckets = index + 1
        buffer.div_(dist.get_world_size(group))

        def square(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            fut.wait()  # the all-reduce is in place: `buffer` holds the sum (a fake backend's
            self.squares[index] = torch.linalg.vector_norm(buffer, dtype=torch.float32).square()
            return buffer  # future carries no tensors, so its value is not read)

        return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(square)

    def take(self) -> torch.Tensor | None:
        """The global gradient norm of the last synchronised backward (None when not every
        bucket reported); each backward's norm is taken once."""
        if self.buckets is None or len(self.squares) != self.buckets:
            return None
        norm = torch.stack(list(self.squares.values())).sum().sqrt()
        self.squares, self.buckets = {}, None
        return norm


def register(model: DistributedDataParallel, opts: Any) -> None:
    """Install the configured hook (DDP keeps the hook's state alive)."""
    name = opts.comm_hook
    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        model.register_comm_hook(None, compress_hook(torch.bfloat16))
    elif name == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=opts.powersgd_rank,
            start_powerSGD_iter=opts.powersgd_start_iter, min_compression_rate=1.0)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    elif name == "topk":
        model.register_comm_hook(TopKState(opts.topk_ratio), topk_hook)
    elif name == "local_sgd":
        # new_subgroups() guesses the group size from the GPUs per node; say it explicitly.
        subgroup, _ = dist.new_subgroups(group_size=opts.local_sgd_group_size)
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=subgroup, start_localSGD_iter=opts.local_sgd_warmup)
        model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)


def wrap_optimizer(optimizer: torch.optim.Optimizer, opts: Any) -> torch.optim.Optimizer:
    """Local SGD averages parameters every `local_sgd_period` steps after the warm-up."""
    if opts.comm_hook != "local_sgd":
        return optimizer
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    averager = PeriodicModelAverager(period=opts.local_sgd_period, warmup_steps=opts.local_sgd_warmup)
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)
