"""Arguments and output of `dtlab estimate` and `dtlab advise`.

    dtlab estimate --n-params 7e9 --world-size 4 --optimizer adamw --precision fp32
    dtlab estimate --config configs/fsdp_gpt.yaml --world-size 2 --strategies ddp,fsdp,fsdp1
    dtlab advise --n-params 7e9 --seq-len 4096 --gpus 8 --gpu-memory 80 --bandwidth 100
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError

GB = 1e9

DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,zero3+offload"
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-autocast", "fp16-autocast")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def count(text: str) -> float:
    """`7e9`, `7B`, `125M`, `1.3b` -> a number of parameters."""
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count such as 7e9, 7B or 125M") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 1")
    return value


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"'{text}' must be positive")
        return value
    return parse


# Options and how to read them. argparse keeps them as text; `validate` converts them, so that a
# bad value ends in dtlab's one-line error like every other bad input.
TYPES: dict[str, Any] = {
    "n_params": count, "n_layer": positive(int), "hidden": positive(int), "n_head": positive(int),
    "seq_len": positive(int), "vocab": positive(int), "micro_batch": positive(int),
    "ranks_per_node": positive(int), "bandwidth": positive(float),
    "inter_node_bandwidth": positive(float), "world_size": positive(int), "gpus": positive(int),
    "gpu_memory": positive(float), "host_memory": positive(float),
}
CHOICES = {"optimizer": OPTIMIZERS, "precision": PRECISIONS, "backend": ("nccl", "gloo")}


def validate(args: argparse.Namespace) -> None:
    for name, convert in TYPES.items():
        text = getattr(args, name, None)
        if isinstance(text, str):
            try:
                setattr(args, name, convert(text))
            except argparse.ArgumentTypeError as e:
                flag = "--" + name.replace("_", "-")
                raise DtlabError(f"{flag}: {e}; fix: e.g. {flag} {EXAMPLES.get(name, '8')}") from None
    for name, allowed in CHOICES.items():
        value = getattr(args, name, None)
        if value is not None and value not in allowed:
            raise DtlabError(f"--{name} '{value}' is not one of {', '.join(allowed)}")
    if hasattr(args, "reserve"):
        try:
            args.reserve = float(args.reserve)
        except ValueError:
            raise DtlabError(f"--reserve '{args.reserve}' is not a number of GB") from None


EXAMPLES = {"n_params": "7e9", "bandwidth": "100", "gpu_memory": "80", "inter_node_bandwidth": "25"}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a dtlab config, or a parameter count)")
    g.add_argument("--config", help="dtlab YAML config: its model, optimizer, precision, batch")
    g.add_argument("--n-params", help="parameter count, e.g. 7e9 or 7B")
    g.add_argument("--n-layer", help="layers (--n-params; default: by rule)")
    g.add_argument("--hidden", help="hidden size (--n-params)")
    g.add_argument("--n-head", help="attention heads (default hidden/128)")
    g.add_argument("--seq-len",
                   help="sequence length (--n-params; activations are estimated when given)")
    g.add_argument("--vocab", default="32000", help="vocabulary (default 32000)")
    g.add_argument("--optimizer", help=f"{', '.join(OPTIMIZERS)} (default adamw; --config: its own)")
    g.add_argument("--precision",
                   help="fp32; bf16/fp16: 16-bit weights and gradients with fp32 master weights; "
                        "*-autocast: fp32 state, 16-bit compute (default fp32; --config: its own)")
    g.add_argument("--micro-batch",
                   help="samples per rank per micro step (default 1; --config: its own)")
    g.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every block (the totals use it)")
    g.add_argument("--ranks-per-node", help="default min(8, world size)")
    c = p.add_argument_group("communication time (optional)")
    c.add_argument("--bandwidth", metavar="GB/s",
                   help="per-link bandwidth inside a node (everywhere, without the next option)")
    c.add_argument("--inter-node-bandwidth", metavar="GB/s")
    c.add_argument("--comm-results", metavar="FILE",
                   help="a dtlab comm --json/--csv file: times from its alpha-beta fit")
    c.add_argument("--backend", help="nccl or gloo (gloo's reduce-scatter is an all-reduce); "
                   "default nccl, --config: what its run would use")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("overrides", nargs="*", help="with --config: dotted overrides")


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--world-size", default="8", help="ranks (default 8)")
    p.add_argument("--strategies", help=f"comma list (default {DEFAULT_STRATEGIES}): ddp, zero1, "
                   "zero2, zero3, hybrid:S, with +offload; with --config also dtlab's strategies "
                   "(fsdp, fsdp1:SHARD_GRAD_OP, tp...): measured under torch's fake backend")


def add_advise_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--gpus", help="GPUs in total (required)")
    p.add_argument("--gpu-memory", metavar="GB", help="memory per GPU (required)")
    p.add_argument("--host-memory", metavar="GB",
                   help="host memory per node, for offloading (default: not checked)")
    p.add_argument("--reserve", default="0", metavar="GB",
                   help="per GPU memory to keep free: CUDA context, allocator (default 0)")


# ------------------------------------------------------------------------------ building a setup
def build_setup(args: argparse.Namespace, world: int) -> Any:
    from dtlab.estimate.comm import Links, load_comm_results
    from dtlab.estimate.core import Setup, model_from_config, model_from_size, optimizer_of
    from dtlab.estimate.memory import PRECISIONS as TABLE

    if args.config and args.n_params:
        raise DtlabError("--config and --n-params both give a model; fix: give one of them")
    if not (args.config or args.n_params or args.overrides):
        raise DtlabError("no model given; fix: --n-params 7e9, or --config FILE (or overrides of "
                         "the built-in config, e.g. model.name=gpt)")
    if args.comm_results and args.bandwidth:
        raise DtlabError("--comm-results and --bandwidth both set a link speed; fix: give one")
    ranks_per_node = args.ranks_per_node or min(8, world)
    if args.n_params is None:  # a config (or the built-in quick config with overrides)
        for flag in ("optimizer", "precision", "n_layer", "hidden", "n_head", "seq_len"):
            if getattr(args, flag) is not None:
                raise DtlabError(f"--{flag.replace('_', '-')} with --config: the config decides; "
                                 f"fix: override it in the config, e.g. train.optimizer=adamw")
        from dtlab.config import check_world, data_parallel_size, load_config
        from dtlab.estimate.core import backend_of, precision_of

        model = model_from_config(args.config, args.overrides)
        cfg = model.cfg
        if cfg.strategy.name == "single" and world > 1:  # the batch splits as with any replicas
            cfg = load_config(args.config, [*args.overrides, "strategy.name=ddp"])
        t, split = cfg.train, data_parallel_size(cfg, world) * cfg.train.grad_accum_steps
        if t.global_batch_size % split and not args.micro_batch:  # state needs no batch
            per_rank = cfg.strategy.pp.microbatches if cfg.strategy.name == "pp" else 1
            model.notes.append(f"train.global_batch_size={t.global_batch_size} does not split "
                               f"over {split} ranks x accumulation steps: activations for a "
                               f"micro batch of {per_rank} (--micro-batch N to choose)")
            cfg = cfg.model_copy(update={"train": t.model_copy(
                update={"global_batch_size": split * per_rank})})
        micro = args.micro_batch or check_world(cfg, world, ranks_per_node)
        precision, optimizer = precision_of(cfg), optimizer_of(cfg)
        backend = args.backend or backend_of(cfg)
    else:
        if args.overrides:
            raise DtlabError(f"overrides {args.overrides} need --config; fix: remove them")
        model = model_from_size(args.n_params, args.n_layer, args.hidden, args.n_head,
                                args.seq_len, args.vocab)
        micro = args.micro_batch or 1
        precision, optimizer = TABLE[args.precision or "fp32"], args.optimizer or "adamw"
        backend = args.backend or "nccl"
    links = None
    if args.comm_results:
        links = load_comm_results(Path(args.comm_results))
    elif args.bandwidth:
        inter = args.inter_node_bandwidth
        links = Links(args.bandwidth * GB, inter * GB if inter else None,
                      source=f"{args.bandwidth:g} GB/s per link" +
                             (f", {inter:g} GB/s between nodes" if inter else ""))
    return Setup(model, world, ranks_per_node, precision, optimizer, micro, args.checkpointing,
                 links, backend)


# ------------------------------------------------------------------------------------- output
def unit_for(values: list[float]) -> tuple[str, float]:
    top = max([abs(v) for v in values] + [0.0])
    return ("GB", 1e9) if top >= 1e9 else ("MB", 1e6)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[str(r.get(key, "")) for key, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(heads, width, strict=True)))]
    for c in cells:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w)
                               for i, (v, w) in enumerate(zip(c, width, strict=True))))
    return "\n".join(lines)


def display_rows(rows: list[dict[str, Any]], scale: float) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        act = r.get("activations")
        t = r["comm"] and r["comm"]["time_s"]
        out.append({
            "strategy": r["strategy"] + MARKS.get(r["source"], ""),
            "params": f"{r['params'] / scale:.2f}", "grads": f"{r['grads'] / scale:.2f}",
            "master": f"{r['master'] / scale:.2f}", "optim": f"{r['optimizer'] / scale:.2f}",
            "state": f"{r['state'] / scale:.2f}",
            "temp": f"{sum(r['temporaries'].values()) / scale:.2f}",
            "act": f"{act['peak'] / scale:.2f}" if act else "-",
            "total": f"{r['device_total'] / scale:.2f}",
            "host": f"{r['host'] / scale:.2f}",
            "comm": "-" if r["comm"] is None else f"{r['comm']['traffic_bytes'] / scale:.2f}",
            "time": "-" if t is None else f"{t * 1e3:.1f}",
            **{k: r[k] for k in ("fits_text", "headroom_text") if k in r},
        })
    return out


MARKS = {"measured (fake backend)": " (measured)", "modelled (DeepSpeed 0.19.8 layout)": " (exact)"}
COLUMNS = [("strategy", "strategy"), ("params", "params"), ("grads", "grads"),
           ("master", "master"), ("optim", "optim"), ("state", "state"), ("temp", "temp"),
           ("act", "activ"), ("total", "total"), ("host", "host"), ("comm", "comm/step"),
           ("time", "comm ms")]

LEGEND = ("per rank, {u}: params/grads/master/optim = training state (state = their sum); temp = "
          "all-gathered units and unsharded gradients during a step (deepspeed: + its reduce buckets "
          "and offload staging buffers, exact); activ = activation peak in "
          "backward (activations.py); total = device memory at the peak (state not offloaded + "
          "temp + activ); host = offloaded state; comm/step = ring traffic sent per rank per step; "
          "comm ms = its predicted time, not overlapped")
SOURCES = ("state bytes: (measured) under torch's fake process-group backend, with dtlab's own "
           "strategy class and metrics.state_bytes; (exact) DeepSpeed's layout, modelled to the "
           "byte; unmarked: the ideal layout, modelled")


def cmd_estimate(args: argparse.Namespace) -> int:
    from dtlab.estimate.core import describe, estimate

    validate(args)
    setup = build_setup(args, args.world_size)
    default = DEFAULT_STRATEGIES if setup.world > 1 else "ddp"
    tokens = [t.strip() for t in (args.strategies or default).split(",") if t.strip()]
    rows = [estimate(setup, t) for t in tokens]
    if args.json:
        print(json.dumps({"setup": setup_dict(setup), "rows": rows}, indent=1))
        return 0
    unit, scale = unit_for([r["device_total"] for r in rows] + [r["state"] for r in rows])
    print(f"dtlab estimate: {describe(setup)}")
    for note in setup.model.notes:
        print(f"  ({note})")
    print(table(display_rows(rows, scale), COLUMNS))
    print(textwrap.fill(LEGEND.format(u=unit), 100))
    if any(r["exact"] for r in rows):
        print(textwrap.fill(SOURCES, 100))
    if setup.links:
        print(f"times from {setup.links.source}")
    for r in rows:
        held = [(p["param_bytes"], p["grad_bytes"], p["optim_bytes"]) for p in r.get("per_rank", [])]
        if len(held) == setup.world and len(set(held)) > 1:
            print(f"{r['strategy']} per rank (param, grad, optim bytes): "
                  + "; ".join(", ".join(map(str, h)) for h in held))
        elif 1 < len(held) < setup.world:  # measured: the ranks that hold the most (measured.py)
            print(f"{r['strategy']} measured ranks of {setup.world} (param, grad, optim bytes): "
                  + "; ".join(f"rank {p['rank']}: " + ", ".join(map(str, h))
                              for p, h in zip(r["per_rank"], held, strict=True)))
        for note in r.get("notes", []):
            print(f"  ({note})")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dtlab.estimate.advise import advise
    from dtlab.estimate.core import describe

    validate(args)
    if args.gpus is None or args.gpu_memory is None:
        raise DtlabError("advise needs --gpus N and --gpu-memory GB; fix: e.g. --gpus 8 "
                         "--gpu-memory 80")
    base = build_setup(args, args.gpus)
    gpu = args.gpu_memory * GB
    result = advise(lambda ckpt: replace(base, checkpointing=ckpt), gpu, args.reserve * GB,
                    args.host_memory * GB if args.host_memory else None)
    if args.json:
        print(json.dumps({"setup": setup_dict(base), **result}, indent=1))
        return 0
    unit, scale = "GB", GB
    print(f"dtlab advise: {describe(base)}; {args.gpu_memory:g} GB per GPU"
          + (f", {args.reserve:g} GB reserved" if args.reserve else ""))
    for note in base.model.notes:
        print(f"  ({note})")
    rows = result["candidates"]
    for r in rows:
        r["fits_text"] = "yes" if r["fits"] else "no (host)" if r.get("host_fits") is False else "no"
        r["headroom_text"] = f"{r['headroom'] / scale:+.2f}"
        if r["checkpointing"]:
            r["strategy"] += " +ckpt"
    cols = [COLUMNS[0], ("state", "state"), ("temp", "temp"), ("act", "activ"),
            ("total", "total"), ("host", "host"), ("fits_text", "fits"),
            ("headroom_text", "headroom"), ("comm", "comm/step"), ("time", "comm ms")]
    print(table(display_rows(rows, scale), cols))
    print(f"per GPU, {unit}; headroom = memory - total" + (" - reserve" if args.reserve else "")
          + ("; no (host): the offloaded state of a node's GPUs exceeds --host-memory"
             if any(r.get("host_fits") is False for r in rows) else ""))
    rec = result["recommendation"]
    print(recommendation_text(rec, gpu, scale))
    return 0


def recommendation_text(rec: dict[str, Any], gpu: float, scale: float) -> str:
    if rec.get("strategy") is None:
        more = (f"; about {rec['gpus_needed']} GPUs would fit zero3 with activation checkpointing"
                if rec.get("gpus_needed") else "")
        return f"advice: nothing fits: {rec['why']}{more}."
    ckpt = " with activation checkpointing" if rec.get("checkpointing") else ""
    mp = f" and tensor parallelism {rec['model_parallel']}" if rec.get("model_parallel") else ""
    used, room = rec["per_gpu_bytes"], rec["headroom_bytes"]
    return (f"advice: {rec['strategy']}{ckpt}{mp} - {used / scale:.2f} of {gpu / scale:.2f} GB "
            f"per GPU, headroom {room / scale:.2f} GB ({100 * room / gpu:.0f}%); {rec['why']}.")


def setup_dict(setup: Any) -> dict[str, Any]:
    return {"model": setup.model.name, "n_params": setup.model.n_params,
            "world_size": setup.world, "ranks_per_node": setup.ranks_per_node,
            "precision": setup.precision.name, "optimizer": setup.optimizer,
            "micro_batch": setup.micro, "checkpointing": setup.checkpointing,
            "backend": setup.backend,
            "links": setup.links.source if setup.links else None, "notes": setup.model.notes}
