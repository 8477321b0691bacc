"""The options of `dtlab comm` and `python -m dtlab.comm.bench`, and their checks: torch-free,
so that `dtlab`'s parser (which lists every command's options) and its refusals of bad sizes do
not wait for torch's import (about 1.5 s of CPU)."""

from __future__ import annotations

import argparse

from dtlab.errors import DtlabError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "send_recv")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    unit = t[-1] if t and t[-1] in UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * UNITS[unit])
    except (ValueError, OverflowError):  # not a number, or inf/nan
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 8, 64K, 128M or 1G") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got '{text}'")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default="all_reduce", choices=[*OPS, "all"])
    p.add_argument("--min-bytes", type=parse_size, default=8)
    p.add_argument("--max-bytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("--factor", type=float, default=2.0, help="size multiplier between steps")
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check", action="store_true", help="verify every element of every result")
    p.add_argument("--p2p", action="store_true", help="also measure every pair of ranks")
    p.add_argument("--p2p-bytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("--json", help="write every measurement as JSON")
    p.add_argument("--csv", help="write one row per op and size as CSV (for dtlab plot)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout (s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--corrupt-rank", type=int, default=-1, help=argparse.SUPPRESS)


def validate(args: argparse.Namespace) -> None:
    if args.min_bytes > args.max_bytes:
        raise DtlabError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if args.factor <= 1:
        raise DtlabError(f"--factor must be above 1, got {args.factor}")
    if args.iters < 1 or args.warmup < 0:
        raise DtlabError("--iters must be at least 1 and --warmup at least 0")
