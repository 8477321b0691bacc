"""The collectives dtlab benchmarks, defined the way nccl-tests defines them.

For each op: the buffers for a message of `count` elements per rank, an out-of-place and an
in-place call (None where torch.distributed has no such form), the result every element must
have (for --check), and the bus-bandwidth factor. Sizes follow nccl-tests: for all_reduce,
broadcast, reduce and send_recv S = count x type size; for all_gather, reduce_scatter and
all_to_all S = count x type size x ranks (the total gathered/scattered size). algbw = S / time;
busbw = algbw x factor, the bandwidth a ring would need on each link, comparable with hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dtlab.comm.arguments import OPS  # noqa: F401 (the ops' names, torch-free)
from dtlab.comm.model import ring_terms

# torch 2.13 renamed the tensor forms; older releases only have the *_into_tensor/_tensor names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TYPE_NAMES = {torch.float32: "float", torch.bfloat16: "bfloat16", torch.float16: "half"}
TOTAL_SIZE_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # S counts every rank's part


def busbw_factor(op: str, n: int) -> float:
    return ring_terms(op, n)[1]  # the ring's factor on S beta: the data each link carries


def message_bytes(op: str, count: int, type_size: int, n: int) -> int:
    return count * type_size * (n if op in TOTAL_SIZE_OPS else 1)


def count_for(op: str, size_bytes: int, type_size: int, n: int) -> int:
    """Elements per rank for a requested S (at least one)."""
    return max(1, size_bytes // message_bytes(op, 1, type_size, n))


def pattern(rank: int, numel: int, dtype: torch.dtype, device: torch.device,
            offset: int = 0) -> torch.Tensor:
    """Small integers, exact in fp16/bf16 even after summing over a few ranks."""
    i = torch.arange(offset, offset + numel, device=device)
    return ((rank + 1) * (i % 5 + 1)).to(dtype)


@dataclass
class Case:
    """Buffers and calls of one op at one size on this rank."""

    prepare: Callable[[], None]  # refill inputs (not timed)
    out_of_place: Callable[[], None] | None
    in_place: Callable[[], None] | None
    result: Callable[[bool], torch.Tensor]  # the tensor to check, for in_place True/False
    expected: torch.Tensor | None  # None: this rank's result is unspecified (reduce, non-root)
    redop: str = "sum"
    root: int = -1


def make_case(op: str, count: int, dtype: torch.dtype, device: torch.device) -> Case:
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    inp = torch.empty(count * (n if op in ("reduce_scatter", "all_to_all") else 1), dtype=dtype,
                      device=device)
    out = torch.empty(count * (n if op in ("all_gather", "all_to_all") else 1), dtype=dtype,
                      device=device)
    holder: dict[str, torch.Tensor] = {}

    if op == "all_reduce":
        def prepare() -> None:
            inp.copy_(pattern(r, count, dtype, device))

        def oop() -> None:  # torch's out-of-place form: the functional collective
            holder["out"] = funcol.wait_tensor(funcol.all_reduce(inp, "sum", group))

        expected = pattern(0, count, dtype, device) * (n * (n + 1) // 2)
        return Case(prepare, oop, lambda: dist.all_reduce(inp),
                    lambda ip: inp if ip else holder["out"], expected)
    if op == "all_gather":
        mine = out.narrow(0, r * count, count)

        def prepare() -> None:
            inp.copy_(pattern(r, count, dtype, device))
            mine.copy_(inp)

        expected = torch.cat([pattern(j, count, dtype, device) for j in range(n)])
        return Case(prepare, lambda: all_gather_single(out, inp),
                    lambda: all_gather_single(out, mine), lambda ip: out, expected,
                    redop="none")
    if op == "reduce_scatter":
        mine = inp.narrow(0, r * count, count)

        def prepare() -> None:
            inp.copy_(pattern(r, count * n, dtype, device))

        expected = pattern(0, count, dtype, device, offset=r * count) * (n * (n + 1) // 2)
        return Case(prepare, lambda: reduce_scatter_single(out, inp),
                    lambda: reduce_scatter_single(mine, inp),
                    lambda ip: mine if ip else out, expected)
    if op == "all_to_all":
        # Rank s sends to rank d the value s + 1 + n * d (+ a position pattern).
        def chunked(src: int) -> torch.Tensor:
            pos = torch.arange(count, device=device) % 3
            return torch.cat([(src + 1 + n * d + pos).to(dtype) for d in range(n)])

        def prepare() -> None:
            inp.copy_(chunked(r))

        pos = torch.arange(count, device=device) % 3
        expected = torch.cat([(s + 1 + n * r + pos).to(dtype) for s in range(n)])
        return Case(prepare, lambda: dist.all_to_all_single(out, inp), None, lambda ip: out,
                    expected, redop="none")
    if op == "broadcast":
        def prepare() -> None:
            inp.copy_(pattern(0, count, dtype, device) if r == 0 else torch.full_like(inp, -1))

        def oop() -> None:
            holder["out"] = funcol.wait_tensor(funcol.broadcast(inp, 0, group))

        return Case(prepare, oop, lambda: dist.broadcast(inp, 0),
                    lambda ip: inp if ip else holder["out"], pattern(0, count, dtype, device),
                    redop="none", root=0)
    if op == "reduce":
        def prepare() -> None:
            inp.copy_(pattern(r, count, dtype, device))

        expected = pattern(0, count, dtype, device) * (n * (n + 1) // 2) if r == 0 else None
        return Case(prepare, None, lambda: dist.reduce(inp, 0), lambda ip: inp, expected, root=0)
    if op == "send_recv":
        # A ring, as nccl-tests' sendrecv: send to the next rank, receive from the previous one.
        def prepare() -> None:
            inp.copy_(pattern(r, count, dtype, device))

        def oop() -> None:
            ops = [dist.P2POp(dist.isend, inp, (r + 1) % n), dist.P2POp(dist.irecv, out, (r - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return Case(prepare, oop, None, lambda ip: out, pattern((r - 1) % n, count, dtype, device),
                    redop="none")
    raise ValueError(f"unknown collective {op}")
