"""Ring attention for context parallelism: each rank holds a contiguous chunk of every sequence;
its queries meet every earlier chunk's keys and values as they pass around the ring, and the
partial outputs are merged by their log-sum-exp (torch's own ring, from
torch.distributed.tensor.experimental._context_parallel: `_templated_ring_attention` and its
backward, without load balancing, so the chunks stay contiguous).

torch's `context_parallel` runs the ring for the CUDA kernels only: on CPU the attention
dispatches to `_scaled_dot_product_flash_attention_for_cpu`, for which it registers nothing
("does not have a sharding strategy registered"). Here the ring calls the kernel of the device
directly (CPU: the flash kernel for CPU and its backward; CUDA: the flash kernel), inside one
autograd function on plain tensors, while `ring(group)` routes
`F.scaled_dot_product_attention` to it. This module goes when torch runs CP on CPU itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as cp

aten = torch.ops.aten


def _ops(device: torch.device) -> tuple[Any, Any]:
    if device.type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    return aten._scaled_dot_product_flash_attention.default, None


@contextlib.contextmanager
def _contiguous_chunks() -> Iterator[None]:
    """torch's ring without its load balancing (which reorders the chunks): forward and
    backward, the backward running after the forward's context has closed."""
    balance = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = False
    try:
        yield
    finally:
        cp._cp_options.enable_load_balance = balance


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                scale: float | None, group: dist.ProcessGroup) -> torch.Tensor:
        forward_op, _ = _ops(q.device)
        with _contiguous_chunks():
            out, lse, *rest = cp._templated_ring_attention(
                group, 2, forward_op, q, k, v, is_causal=is_causal, dropout_p=0.0, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, *[t for t in rest if isinstance(t, torch.Tensor)])
        ctx.is_causal, ctx.scale, ctx.group = is_causal, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors[:5]
        _, backward_op = _ops(q.device)
        if backward_op is None:
            raise NotImplementedError("ring attention's backward on CUDA goes through torch's "
                                      "context_parallel")
        with _contiguous_chunks():
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                ctx.group, 2, backward_op, grad_out.contiguous(), "grad_out", q, k, v, out, lse,
                ctx.is_causal, dropout_p=0.0, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


@contextlib.contextmanager
def ring(group: dist.ProcessGroup) -> Iterator[None]:
    """Inside: F.scaled_dot_product_attention runs as ring attention over `group` (no mask, no
    dropout: the checks refuse them), the chunks contiguous."""
    original = F.scaled_dot_product_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  **kwargs: Any) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            raise NotImplementedError("ring attention takes no mask and no dropout")
        return RingAttention.apply(q, k, v, is_causal, scale, group)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
