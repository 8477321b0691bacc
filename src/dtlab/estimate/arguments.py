"""Arguments of `dtlab estimate` and `dtlab advise`: the model (a config or a parameter count),
the communication inputs, the world; their bounds, and the checks that need more than one option.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from dtlab.cli_args import integer, number
from dtlab.config.strategies import registry
from dtlab.errors import DtlabError
from dtlab.estimate.memory import PRECISIONS

GB = 1e9
MAX_PARAMS = 1e15  # a thousand times the largest models trained; beyond it the arithmetic is moot
MAX_LAYERS = 100_000  # the estimate walks each block: more would take minutes, not milliseconds
DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,zero3+offload"
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def count(text: str) -> float:
    """An argparse type: `7e9`, `7B`, `125M`, `1.3b` -> a number of parameters."""
    t, fix = text.strip().upper(), "; fix: e.g. --n-params 7e9"
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count such as 7e9, 7B or 125M{fix}") from None
    if not math.isfinite(value) or not 1 <= value <= MAX_PARAMS:
        why = ("is not a finite count" if not math.isfinite(value) else "must be at least 1"
               if value < 1 else f"is more than {MAX_PARAMS:.0e}, the most this estimate takes")
        raise argparse.ArgumentTypeError(f"'{text}' {why}{fix}")
    return value


def positive(example: str, kind: type = float, maximum: int | None = None) -> Any:
    return integer(1, example, maximum) if kind is int else number(0, example, inclusive=False)


def validate(args: argparse.Namespace) -> None:
    """What argparse cannot check one option at a time."""
    if getattr(args, "strategies", None) is not None and not args.strategies.replace(",", "").strip():
        raise DtlabError(f"--strategies '{args.strategies}' names no strategy; fix: e.g. "
                         f"--strategies {DEFAULT_STRATEGIES}")
    if args.comm_results and args.bandwidth:
        raise DtlabError("--comm-results and --bandwidth both set a link speed; fix: give one")
    tokens = [t.strip() for t in (getattr(args, "strategies", None) or "").split(",") if t.strip()]
    for token in tokens if getattr(args, "world_size", None) else []:  # @DPxMP: its own ranks
        wrong = registry.mesh_mismatch(token, args.world_size, "--world-size")
        if wrong:
            raise DtlabError(wrong)
    twice = next((t for i, t in enumerate(tokens) if t in tokens[:i]), None)
    if twice:
        raise DtlabError(f"--strategies '{args.strategies}' has '{twice}' twice; fix: list each "
                         "strategy once, separated by commas")
    if getattr(args, "gpu_memory", None) is not None and args.reserve >= args.gpu_memory:
        raise DtlabError(f"--reserve {args.reserve:g} GB leaves nothing of --gpu-memory "
                         f"{args.gpu_memory:g} GB; fix: a reserve below the memory per GPU, "
                         "e.g. --reserve 2")
    world = getattr(args, "world_size", None) or getattr(args, "gpus", None)
    per_node = args.ranks_per_node
    if per_node and world > per_node and world % per_node:
        flag = "--world-size" if getattr(args, "world_size", None) else "--gpus"
        raise DtlabError(f"{flag} {world} is not a whole number of nodes of --ranks-per-node "
                         f"{per_node}; fix: a multiple of {per_node}, e.g. {flag} "
                         f"{world - world % per_node or per_node}")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a dtlab config, or a parameter count)")
    for flag, metavar, kind, text in (
        ("--config", "FILE", str, "dtlab YAML config whose model, optimizer, precision and batch "
                                  "are estimated (default: none; give this or --n-params)"),
        ("--n-params", "N", count, "parameter count of a GPT-like model, e.g. 7e9 or 7B "
                                   "(default: none; give this or --config)"),
        ("--n-layer", "N", int, "transformer layers, with --n-params (default: by the hidden = "
                                "128 x layers rule)"),
        ("--hidden", "N", int, "hidden size, with --n-params (default: 128 x layers)"),
        ("--n-head", "N", int, "attention heads, with --n-params (default: hidden / 128)"),
        ("--seq-len", "TOKENS", int, "sequence length in tokens, with --n-params; activations "
                                     "are estimated when given (default: none, state only)"),
        ("--micro-batch", "N", int, "samples per rank per micro step (default: 1; --config: its "
                                    "own)"),
        ("--ranks-per-node", "N", int, "ranks (GPUs) per node (default: min(8, world size))")):
        g.add_argument(flag, metavar=metavar, help=text, type=kind if kind in (str, count) else
                       positive(f"{flag} 8", kind, MAX_LAYERS if flag == "--n-layer" else None))
    g.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME",
                   help=f"one of {', '.join(OPTIMIZERS)} (default: adamw; --config: its own)")
    g.add_argument("--precision", choices=tuple(PRECISIONS), metavar="NAME",
                   help="fp32; bf16/fp16: 16-bit weights and gradients with fp32 master weights; "
                        "*-autocast: fp32 state, 16-bit compute (default: fp32; --config: its own)")
    g.add_argument("--vocab", default=32000, type=positive("--vocab 32000", int), metavar="TOKENS",
                   help="vocabulary size in tokens, with --n-params")
    g.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every block (the totals use it; "
                        "--config: also its train.activation_checkpointing)")
    c = p.add_argument_group("communication time (optional)")
    for flag, text in (
        ("--bandwidth", "per-link bandwidth inside a node in GB/s, used everywhere without "
                        "--inter-node-bandwidth (default: none, no times)"),
        ("--inter-node-bandwidth", "per-link bandwidth between nodes in GB/s (default: "
                                   "--bandwidth)")):
        c.add_argument(flag, metavar="GB/s", type=positive(f"{flag} 100"), help=text)
    c.add_argument("--comm-results", metavar="FILE", help="a dtlab comm --json/--csv file: times "
                   "from its alpha-beta fit (default: none)")
    c.add_argument("--backend", choices=("nccl", "gloo"), help="nccl or gloo (gloo's "
                   "reduce-scatter is an all-reduce) (default: nccl; --config: what its run would use)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="with --config: dotted config overrides (default: none)")


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--world-size", default=8, type=positive("--world-size 8", int), metavar="N",
                   help="ranks (GPUs) in total")
    p.add_argument("--strategies", metavar="LIST",
                   help=f"comma list (default: {DEFAULT_STRATEGIES}): ddp, zero1, "
                   "zero2, zero3, hybrid:S, with +offload; with --config also dtlab's strategies "
                   "(fsdp, fsdp1:SHARD_GRAD_OP, fsdp@tp2, tp...): measured under torch's fake backend")


def add_advise_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--gpus", type=positive("--gpus 8", int), metavar="N", required=True,
                   help="GPUs in total (required, no default)")
    p.add_argument("--gpu-memory", type=positive("--gpu-memory 80"), metavar="GB", required=True,
                   help="memory per GPU in GB (required, no default)")
    p.add_argument("--host-memory", type=positive("--host-memory 2000"), metavar="GB",
                   help="host memory per node in GB, for offloading (default: not checked)")
    p.add_argument("--reserve", default=0.0, type=number(0, "--reserve 2"), metavar="GB",
                   help="memory per GPU to keep free in GB: CUDA context, allocator (default: 0)")
    p.add_argument("--cluster", metavar="NAME|FILE", help="with --config: also search the "
                   "layouts of --gpus (data-parallel strategies, tensor and pipeline degrees), "
                   "and rank the fastest that fit by their step time predicted on this cluster "
                   "(dtlab predict; default: memory only)")
    p.add_argument("--trace-most", type=positive("--trace-most 4", int), default=4, metavar="N",
                   help="with --cluster: layouts traced by dtlab predict, the fastest that fit "
                   "by the screen (default: 4)")
    p.add_argument("--search-budget", type=positive("--search-budget 120"), default=120.0,
                   metavar="SECONDS", help="with --cluster: stop tracing more layouts after "
                   "this many seconds (default: 120; the first is always traced)")
