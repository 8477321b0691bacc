"""What `dtlab estimate` and `dtlab advise` do and print (their arguments: arguments.py).

    dtlab estimate --n-params 7e9 --world-size 4 --optimizer adamw --precision fp32
    dtlab estimate --config configs/fsdp_gpt.yaml --world-size 2 --strategies ddp,fsdp,fsdp1
    dtlab advise --n-params 7e9 --seq-len 4096 --gpus 8 --gpu-memory 80 --bandwidth 100
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

from dtlab.config.strategies import registry
from dtlab.errors import DtlabError
from dtlab.estimate.arguments import (  # noqa: F401 (dtlab.cli takes the add_* from here)
    DEFAULT_STRATEGIES,
    GB,
    add_advise_arguments,
    add_estimate_arguments,
    validate,
)
from dtlab.estimate.memory import PRECISIONS
from dtlab.process.result_stdout import print_result


# ------------------------------------------------------------------------------ building a setup
def build_setup(args: argparse.Namespace, world: int) -> Any:
    from dtlab.config.device import backend_type
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
    from dtlab.levers.activation_checkpoint import chosen_blocks

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
             "host": mb(r["host"]), "disk": mb(r.get("disk", 0)), "comm/step": mb(r["comm"] and r["comm"]["traffic_bytes"]),
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
DISK = ("; disk = the swap files of NVMe offload (ZeRO-Infinity), exact; host then holds its "
        "swap buffers and the tensors under 1 MiB it does not swap")
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
    rows = [estimate(setup, t.strip()) for t in (args.strategies or default).split(",")
            if t.strip()]
    if args.json:
        print_result(json.dumps({"setup": setup_dict(setup), "rows": rows}, indent=1))
        return 0
    top = max([abs(v) for r in rows for v in (r["device_total"], r["state"])] + [0.0])
    unit, scale = ("GB", 1e9) if top >= 1e9 else ("MB", 1e6)
    header("estimate", setup)
    disk = any(r.get("disk") for r in rows)  # NVMe offload: a column for its swap files
    columns = [*COLUMNS[:10], "disk", *COLUMNS[10:]] if disk else COLUMNS
    print(table(display_rows(rows, scale), columns))
    print(textwrap.fill(LEGEND.format(u=unit) + (DISK if disk else ""), 100))
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


def advise_result(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(the setup, advise's candidates and recommendation) of `dtlab advise`'s arguments."""
    from dtlab.estimate.advise import advise

    validate(args)
    base = build_setup(args, args.gpus)
    return base, advise(lambda ckpt: replace(base, checkpointing=ckpt), args.gpu_memory * GB,
                        args.reserve * GB, args.host_memory * GB if args.host_memory else None)


def cmd_advise(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> int:
    """`extra`: more of the answer (dtlab predict's ranking by step time), for --json."""
    base, result = advise_result(args)
    gpu = args.gpu_memory * GB
    if args.json:
        print_result(json.dumps({"setup": setup_dict(base), **result, **(extra or {})},
                                indent=1))
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
