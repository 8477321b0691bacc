"""`dtlab predict --validate`: each strategy predicted and run here, on 1, 2 and 4 local ranks
(or on the --world-size asked).

The prediction measures compute on this device at the strategy's per-rank shapes (core.
predict_step) and prices communication with the cluster's links (cpu_gloo: a dtlab comm fit of
this machine); the run is a real `dtlab train` (truth.measure_run), its median step time after
warm-up, over enough steps that the median holds still from run to run (run_steps). A world
size the strategy cannot take is skipped with its reason.
Where the ranks outnumber the cores, both the run and the prediction share them (the prediction
says by how much it scaled the compute).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from dtlab.config.strategies import registry
from dtlab.errors import ConfigError
from dtlab.process.result_stdout import print_result

RANKS = (1, 2, 4)
# A run's timed steps (truth.warmup_of's untimed steps run first): about TIMED_S of them, between
# MIN_TIMED and MAX_TIMED. Short steps spread wide here, so a few dozen of them give a median that
# moves from run to run by more than a prediction's error: the quick CNN's ddp on 4 ranks gave
# medians of 13.2-19.6 ms in five runs of 32 timed steps, 15.9-17.2 ms in five of 96; a GPT's
# 90 ms steps hold still over 8 (docs/benchmarks.md, 2026-11-29).
TIMED_S, MIN_TIMED, MAX_TIMED = 1.5, 8, 96


def run_steps(predicted_s: float) -> int:
    """The steps of a run whose step is predicted to take `predicted_s` (TIMED_S)."""
    timed = min(MAX_TIMED, max(MIN_TIMED, math.ceil(TIMED_S / max(predicted_s, 1e-6))))
    return timed + timed // 2  # truth.warmup_of leaves a third of them untimed


def validate_rows(path: str | None, overrides: list[str], tokens: list[str], cluster: Any,
                  ranks: tuple[int, ...] = RANKS,
                  steps: int | None = None) -> list[dict[str, Any]]:
    """Each (strategy, ranks): predicted, then run; `steps`: each run's (None: run_steps)."""
    from dtlab.predict.core import Request, predict_step, strategy_config
    from dtlab.predict.truth import measure_run

    rows = []
    for token in tokens:
        for n in ranks:
            try:
                strategy_config(Request(path, overrides, n, n, cluster), token)
            except ConfigError as e:
                rows.append({"strategy": token, "ranks": n, "skipped": str(e)})
                continue
            predicted = predict_step(path, overrides, token, n, cluster)
            run = steps or run_steps(predicted["step_s"])
            measured = measure_run(path, [*overrides, *registry.parse(token)], n, run)
            error = predicted["step_s"] / measured["step_s"] - 1
            rows.append({"strategy": token, "ranks": n, "predicted_s": predicted["step_s"],
                         "measured_s": measured["step_s"], "steps": run, "error": error,
                         "sources": predicted["sources"], "notes": predicted["notes"]})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    errors = [abs(r["error"]) for r in rows if "error" in r]
    return {"rows": len(errors), "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "max_abs_error": max(errors, default=None)}


def cmd_validate(args: argparse.Namespace) -> int:
    from dtlab.estimate.cli import table
    from dtlab.predict.cluster import load_cluster

    cluster = load_cluster(args.cluster or "cpu_gloo")
    tokens = [t.strip() for t in args.strategies.split(",")]
    ranks = (args.world_size,) if args.world_size else RANKS
    rows = validate_rows(args.config, list(args.overrides), tokens, cluster, ranks)
    total = summary(rows)
    if args.json:
        print_result(json.dumps({"cluster": cluster.name, "rows": rows, **total}, indent=1))
        return 0
    shown = [{"strategy": r["strategy"], "ranks": str(r["ranks"]),
              "predicted ms": f"{r['predicted_s'] * 1e3:.1f}",
              "measured ms": f"{r['measured_s'] * 1e3:.1f}", "error": f"{100 * r['error']:+.1f}%",
              "steps": str(r["steps"])}
             for r in rows if "error" in r]
    print(f"dtlab predict --validate: {cluster.name}; measured: the median step after the run's "
          f"first third, runs sized to time about {TIMED_S:g} s ({MIN_TIMED}-{MAX_TIMED} timed steps)")
    if shown:
        print(table(shown, list(shown[0])))
    if total["mean_abs_error"] is not None:
        print(f"mean |error| {100 * total['mean_abs_error']:.1f}%, largest "
              f"{100 * total['max_abs_error']:.1f}% over {total['rows']} runs")
    for r in rows:
        if "skipped" in r:
            print(f"  ({r['strategy']} on {r['ranks']} ranks: skipped, {r['skipped']})")
    return 0
