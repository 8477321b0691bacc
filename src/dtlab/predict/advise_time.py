"""`dtlab advise --cluster`: the layouts of --gpus searched, and those that fit ranked by their
predicted step time.

advise (estimate/advise.py) finds the ideal data-parallel layouts whose memory fits a GPU; with a
cluster, layout_search.py searches every layout (data-parallel strategies, tensor and pipeline
degrees, microbatch counts), screens them, and traces the fastest that fit with dtlab predict
(core.py). This prints the search, predict's ranking, and why the best wins.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from dtlab.config.strategies import registry
from dtlab.errors import DtlabError

GB = 1e9
SHOWN = 12  # rows of the search printed (--json has them all)


def searched(args: argparse.Namespace) -> list[Any]:
    """layout_search.search on the arguments' config, GPUs and cluster."""
    from dtlab.predict.cluster import load_cluster
    from dtlab.predict.core import Request
    from dtlab.predict.layout_search import search

    data_parallel = [s.name for s in registry.SPECS.values() if s.textbook and not s.one_process]
    cluster = load_cluster(args.cluster)
    per_node = args.ranks_per_node or min(args.gpus, cluster.gpus_per_node)
    req = Request(args.config, list(args.overrides), args.gpus, per_node, cluster)
    budget = (args.gpu_memory - args.reserve) * GB
    return search(req, data_parallel, args.search_budget, budget, args.trace_most)


def why_best(found: list[Any], budget: float) -> str:
    """What the best traced layout wins on against the others (the screen's parts of a step)."""
    traced = [c for c in found if c.predicted]
    if not traced:
        return ""
    best, said = traced[0], []
    parts = {"compute_s": "compute", "bubble_s": "pipeline bubble",
             "tp_comm_s": "tensor-parallel communication",
             "dp_comm_exposed_s": "exposed data-parallel communication"}
    for c in [*traced[1:3], *(c for c in found if c.rough and c.rough["device_bytes"] > budget)][:4]:
        if c.rough["device_bytes"] > budget:
            said.append(f"{c.label} does not fit ({c.rough['device_bytes'] / GB:,.1f} GB per rank)")
            continue
        key = max(parts, key=lambda k: c.rough[k] - best.rough[k])
        extra = c.rough[key] - best.rough[key]
        if extra * 1e3 < 1:  # the screen tells them apart by nothing: predict's trace does
            slower = c.predicted["step_s"] / best.predicted["step_s"] if c.predicted else 1.0
            said.append(f"{c.label} is {slower:.2f}x its step time in the trace (the screen's "
                        "parts are the same)")
            continue
        said.append(f"{c.label} spends {extra * 1e3:,.0f} ms more a step in {parts[key]}")
    return f"{best.label} wins: " + "; ".join(said) if said else f"{best.label} is the only one traced"


def _rough(c: Any) -> tuple[str, str]:
    if not c.rough:
        return "-", "-"
    act = c.rough["activation_bytes"]
    gb = f"{c.rough['device_bytes'] / GB:,.1f}" + ("" if not math.isnan(act) else " (state)")
    return f"{c.rough['step_s'] * 1e3:,.0f}", gb


def cmd_advise(args: argparse.Namespace) -> int:
    from dtlab.estimate.cli import cmd_advise as memory_advice
    from dtlab.predict.cli import ms
    from dtlab.predict.core import CLOSE_CALL, CLOSE_CALL_WHY

    if args.cluster is None:
        return memory_advice(args)
    if not args.config:
        raise DtlabError("--cluster ranks dtlab strategies of a config by step time; fix: add "
                         "--config FILE, or drop --cluster")
    found = searched(args)
    budget = (args.gpu_memory - args.reserve) * GB
    traced = [c for c in found if c.predicted]
    fastest = traced[0].predicted["step_s"] if traced else None
    keep = ("step_s", "samples_per_s", "mfu", "fits")
    rows = [{"strategy": c.label, **{k: c.predicted.get(k) for k in keep},
             "slower": c.predicted["step_s"] / fastest} for c in traced]
    if args.json:
        every = [{"layout": c.layout, "microbatches": c.microbatches, "refused": c.why_not,
                  "screen": c.rough or None, "predicted_step_s": c.predicted and
                  c.predicted["step_s"]} for c in found]
        return memory_advice(args, {"by_step_time": rows, "searched": every,
                                    "cluster": args.cluster, "why": why_best(found, budget)})
    memory_advice(args)
    refused = [c for c in found if c.why_not]
    print(f"\nlayouts searched on {args.gpus} GPUs of {args.cluster}: {len(found)}, "
          f"{len(refused)} refused by dtlab's checks; screened by a model of the step, the "
          f"{len(traced)} fastest that fit traced by dtlab predict:")
    print(f"  {'layout':<22} {'screen ms':>10} {'GB/rank':>14} {'predicted ms':>13}")
    shown = [c for c in found if not c.why_not]
    for c in shown[:SHOWN]:
        step, gb = _rough(c)
        pred = ms(c.predicted["step_s"]) if c.predicted else "-"
        print(f"  {c.label:<22} {step:>10} {gb:>14} {pred:>13}"
              + ("" if c.rough["device_bytes"] <= budget else "  does not fit"))
    if len(shown) > SHOWN:
        over = sum(c.rough["device_bytes"] > budget for c in shown[SHOWN:])
        print(f"  ... and {len(shown) - SHOWN} slower by the screen ({over} of them do not fit)")
    for c in refused[:3]:
        print(f"  {c.label}: refused: {c.why_not}")
    if len(refused) > 3:
        print(f"  ... and {len(refused) - 3} more refused (--json lists every layout searched)")
    print(f"by predicted step time on {args.cluster} (dtlab predict):")
    close = False
    for r in rows:
        close |= 1 < r["slower"] < CLOSE_CALL
        print(f"  {r['strategy']}: {ms(r['step_s'])} ms per step"
              + (" (fastest)" if r["slower"] == 1 else f", {r['slower']:.2f}x the fastest"))
    if why := why_best(found, budget):
        print(f"  {why}")
    if close:
        print(f"  (the fastest and those within {CLOSE_CALL}x of it: {CLOSE_CALL_WHY})")
    if any(c.rough and math.isnan(c.rough["activation_bytes"]) for c in found):
        print("  (state): activations of this model are not modelled, GB/rank is its state alone")
    return 0
