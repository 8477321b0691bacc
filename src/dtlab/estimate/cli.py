"""Arguments and output of `dtlab estimate` and `dtlab advise`.

    dtlab estimate --n-params 7e9 --world-size 4 --optimizer adamw --precision fp32
    dtlab estimate --config configs/fsdp_gpt.yaml --world-size 2 --strategies ddp,fsdp,fsdp1
    dtlab advise --n-params 7e9 --seq-len 4096 --gpus 8 --gpu-memory 80 --bandwidth 100
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

from dtlab.cli_args import integer, number
from dtlab.errors import DtlabError
from dtlab.estimate.memory import PRECISIONS
from dtlab.strategies import registry

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
                   "(fsdp, fsdp1:SHARD_GRAD_OP, tp...): measured under torch's fake backend")


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


# ------------------------------------------------------------------------------ building a setup
def build_setup(args: argparse.Namespace, world: int) -> Any:
    from dtlab.config.world import backend_type
    from dtlab.estimate import core
    from dtlab.estimate.comm import Links, load_comm_results

    if args.config and args.n_params:
        raise DtlabError("--config and --n-params both give a model; fix: give one of them")
    if not (args.config or args.n_params or args.overrides):
        raise DtlabError("no model given; fix: --n-params 7e9, or --config FILE (or overrides of "
                         "the built-in config, e.g. model.name=gpt)")
    ranks_per_node, inter = args.ranks_per_node or min(8, world), args.inter_node_bandwidth
    if args.n_params is None:  # a config (or the built-in quick config with overrides)
        for flag in ("optimizer", "precision", "n_layer", "hidden", "n_head", "seq_len"):
            if getattr(args, flag) is not None:
                raise DtlabError(f"--{flag.replace('_', '-')} with --config: the config decides; "
                                 f"fix: override it in the config, e.g. train.optimizer=adamw")
        model = core.model_from_config(args.config, args.overrides)
        micro, cfg = config_batch(args, model, world, ranks_per_node)
        precision, optimizer = core.precision_of(cfg), core.optimizer_of(cfg)
        backend = args.backend or backend_type(cfg)
    else:
        if args.overrides:
            raise DtlabError(f"overrides {args.overrides} need --config; fix: remove them")
        model = core.model_from_size(args.n_params, args.n_layer, args.hidden, args.n_head,
                                     args.seq_len, args.vocab)
        micro, precision = args.micro_batch or 1, PRECISIONS[args.precision or "fp32"]
        optimizer, backend = args.optimizer or "adamw", args.backend or "nccl"
    links = load_comm_results(Path(args.comm_results)) if args.comm_results else None
    if args.bandwidth:
        links = Links(args.bandwidth * GB, inter * GB if inter else None,
                      source=f"{args.bandwidth:g} GB/s per link"
                      + (f", {inter:g} GB/s between nodes" if inter else ""))
    checkpointing = args.checkpointing or (config_checkpointing(model) if args.config else False)
    return core.Setup(model, world, ranks_per_node, precision, optimizer, micro,
                      checkpointing, links, backend)


def config_checkpointing(model: Any) -> bool | tuple[int, ...]:
    """The blocks a config's train.activation_checkpointing recomputes (full: all)."""
    from dtlab.activation_checkpoint import chosen_blocks

    t = model.cfg.train
    if t.activation_checkpointing != "selective" or model.segments is None:
        return t.activation_checkpointing == "full"
    n_blocks = sum(s.block for s in model.segments(1, "fp32"))
    return tuple(chosen_blocks(n_blocks, "selective", t.ac_every))


def config_batch(args: argparse.Namespace, model: Any, world: int, ranks_per_node: int) -> Any:
    """(micro batch, config) of a config's run on `world` ranks. A global batch that does not
    split over them leaves the state estimate standing (it needs no batch): one sample, noted."""
    from dtlab.config import check_world, data_parallel_size, load_config
    from dtlab.estimate.measure import one_sample_per_rank

    cfg = model.cfg
    if registry.of(cfg).one_process and world > 1:  # the batch splits as with any replicas
        cfg = load_config(args.config, [*args.overrides, f"strategy.name={registry.BASELINE}"])
    t, split = cfg.train, data_parallel_size(cfg, world) * cfg.train.grad_accum_steps
    if t.global_batch_size % split and not args.micro_batch:
        cfg = one_sample_per_rank(cfg, world)
        model.notes.append(f"train.global_batch_size={t.global_batch_size} does not split over "
                           f"{split} ranks x accumulation steps: activations for a micro batch of "
                           f"{cfg.train.global_batch_size // split} (--micro-batch N to choose)")
    return args.micro_batch or check_world(cfg, world, ranks_per_node), cfg


# ------------------------------------------------------------------------------------- output
def table(rows: list[dict[str, str]], columns: list[str]) -> str:
    cells = [columns] + [[r[c] for c in columns] for r in rows]
    width = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) if i else v.ljust(w)
                               for i, (v, w) in enumerate(zip(c, width, strict=True))) for c in cells)


MARKS = {"measured (fake backend)": " (measured)", "modelled (DeepSpeed 0.19.8 layout)": " (exact)"}


def display_rows(rows: list[dict[str, Any]], scale: float) -> list[dict[str, Any]]:
    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value / scale:.2f}"

    return [{"strategy": r["strategy"] + MARKS.get(r["source"], ""), "params": mb(r["params"]),
             "grads": mb(r["grads"]), "master": mb(r["master"]), "optim": mb(r["optimizer"]),
             "state": mb(r["state"]), "temp": mb(sum(r["temporaries"].values())),
             "activ": mb(r.get("activations", {}).get("peak")), "total": mb(r["device_total"]),
             "host": mb(r["host"]), "comm/step": mb(r["comm"] and r["comm"]["traffic_bytes"]),
             "comm ms": "-" if not r["comm"] or r["comm"]["time_s"] is None
             else f"{r['comm']['time_s'] * 1e3:.1f}", **r.get("shown", {})} for r in rows]


COLUMNS = ["strategy", "params", "grads", "master", "optim", "state", "temp", "activ", "total",
           "host", "comm/step", "comm ms"]  # display_rows' keys, shown as they are
LEGEND = ("per rank, {u}: params/grads/master/optim = training state (state = their sum); temp = "
          "all-gathered units and unsharded gradients during a step (deepspeed: + its reduce buckets "
          "and offload staging buffers, exact); activ = activation peak in "
          "backward (activations.py); total = device memory at the peak (state not offloaded + "
          "temp + activ); host = offloaded state; comm/step = ring traffic sent per rank per step; "
          "comm ms = its predicted time, not overlapped")
SOURCES = ("state bytes: (measured) under torch's fake process-group backend, with dtlab's own "
           "strategy class and metrics.state_bytes; (exact) DeepSpeed's layout, modelled to the "
           "byte; unmarked: the ideal layout, modelled")


def header(command: str, setup: Any, extra: str = "") -> None:
    from dtlab.estimate.core import describe

    print(f"dtlab {command}: {describe(setup)}{extra}")
    print("".join(f"  ({note})\n" for note in setup.model.notes), end="")


def cmd_estimate(args: argparse.Namespace) -> int:
    from dtlab.estimate.core import estimate

    validate(args)
    setup = build_setup(args, args.world_size)
    default = DEFAULT_STRATEGIES if setup.world > 1 else registry.BASELINE
    rows = [estimate(setup, t.strip()) for t in (args.strategies or default).split(",") if t.strip()]
    if args.json:
        print(json.dumps({"setup": setup_dict(setup), "rows": rows}, indent=1))
        return 0
    top = max([abs(v) for r in rows for v in (r["device_total"], r["state"])] + [0.0])
    unit, scale = ("GB", 1e9) if top >= 1e9 else ("MB", 1e6)
    header("estimate", setup)
    print(table(display_rows(rows, scale), COLUMNS))
    print(textwrap.fill(LEGEND.format(u=unit), 100))
    if any(r["exact"] for r in rows):
        print(textwrap.fill(SOURCES, 100))
    if setup.links:
        print(f"times from {setup.links.source}")
    for r in rows:  # per rank: every rank's bytes where they differ, or the ranks measured
        ranks = r.get("per_rank", [])
        held = [f"{p['param_bytes']}, {p['grad_bytes']}, {p['optim_bytes']}" for p in ranks]
        full = len(held) == setup.world
        if len(set(held)) > 1 if full else len(held) > 1:
            print(f"{r['strategy']} {'per rank' if full else f'measured ranks of {setup.world}'} "
                  "(param, grad, optim bytes): " + "; ".join(
                      h if full else f"rank {p['rank']}: {h}" for p, h in zip(ranks, held, strict=True)))
        print("".join(f"  ({note})\n" for note in r.get("notes", [])), end="")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from dtlab.estimate.advise import advise

    validate(args)
    base = build_setup(args, args.gpus)
    gpu = args.gpu_memory * GB
    result = advise(lambda ckpt: replace(base, checkpointing=ckpt), gpu, args.reserve * GB,
                    args.host_memory * GB if args.host_memory else None)
    if args.json:
        print(json.dumps({"setup": setup_dict(base), **result}, indent=1))
        return 0
    header("advise", base, f"; {args.gpu_memory:g} GB per GPU"
           + (f", {args.reserve:g} GB reserved" if args.reserve else ""))
    rows = result["candidates"]
    for r in rows:  # (after the JSON: these are for the table only)
        r["shown"] = {"fits": "yes" if r["fits"] else "no (host)" if r.get("host_fits") is False
                      else "no", "headroom": f"{r['headroom'] / GB:+.2f}"}
        r["strategy"] += " +ckpt" if r["checkpointing"] else ""
    columns = [COLUMNS[0], *COLUMNS[5:10], "fits", "headroom", *COLUMNS[10:]]
    print(table(display_rows(rows, GB), columns))
    print("per GPU, GB; headroom = memory - total" + (" - reserve" if args.reserve else "")
          + ("; no (host): the offloaded state of a node's GPUs exceeds --host-memory"
             if any(r.get("host_fits") is False for r in rows) else ""))
    print(recommendation_text(result["recommendation"], gpu))
    return 0


def recommendation_text(rec: dict[str, Any], gpu: float) -> str:
    if rec.get("strategy") is None:
        more = (f"; about {rec['gpus_needed']} GPUs would fit zero3 with activation checkpointing"
                if rec.get("gpus_needed") else "")
        return f"advice: nothing fits: {rec['why']}{more}."
    ckpt = " with activation checkpointing" if rec.get("checkpointing") else ""
    mp = f" and tensor parallelism {rec['model_parallel']}" if rec.get("model_parallel") else ""
    used, room = rec["per_gpu_bytes"], rec["headroom_bytes"]
    return (f"advice: {rec['strategy']}{ckpt}{mp} - {used / GB:.2f} of {gpu / GB:.2f} GB "
            f"per GPU, headroom {room / GB:.2f} GB ({100 * room / gpu:.0f}%); {rec['why']}.")


def setup_dict(setup: Any) -> dict[str, Any]:
    return {"model": setup.model.name, "n_params": setup.model.n_params,
            "world_size": setup.world, "ranks_per_node": setup.ranks_per_node,
            "precision": setup.precision.name, "optimizer": setup.optimizer,
            "micro_batch": setup.micro, "checkpointing": setup.checkpointing,
            "backend": setup.backend,
            "links": setup.links.source if setup.links else None, "notes": setup.model.notes}
