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
import re
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
    """Each (strategy, ranks): predicted, then run; `steps`: each run's (None: run_steps).
    A ConfigError, before anything is measured, when every one is refused."""
    from dtlab.predict.core import predict_step
    from dtlab.predict.truth import measure_run

    rows = planned(path, overrides, tokens, ranks)
    for row in rows:
        if "skipped" in row:
            continue
        token, n = row["strategy"], row["ranks"]
        predicted = predict_step(path, overrides, token, n, cluster)
        run = steps or run_steps(predicted["step_s"])
        measured = measure_run(path, [*overrides, *registry.parse(token)], n, run)
        row.update(predicted_s=predicted["step_s"], measured_s=measured["step_s"], steps=run,
                   error=predicted["step_s"] / measured["step_s"] - 1,
                   sources=predicted["sources"], notes=predicted["notes"])
    return rows


def planned(path: str | None, overrides: list[str], tokens: list[str],
            ranks: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each (strategy, ranks), with why it is skipped where its config refuses that world; a
    ConfigError when every one is: a validation of nothing is no answer."""
    from dtlab.predict.core import Request, strategy_config

    rows: list[dict[str, Any]] = []
    for token in tokens:
        for n in ranks:
            row: dict[str, Any] = {"strategy": token, "ranks": n}
            try:
                strategy_config(Request(path, overrides, n, n, None), token)
            except ConfigError as e:
                row["skipped"] = str(e)
            rows.append(row)
    if all("skipped" in r for r in rows):
        first = rows[0]
        rest = [f"{r['strategy']} on {r['ranks']}" for r in rows[1:]]
        others = f" (and so are {', '.join(rest)})" if rest else ""
        raise ConfigError(f"--validate has nothing to run: {first['strategy']} on "
                          f"{first['ranks']} ranks is refused{others}: {first['skipped']}")
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    errors = [abs(r["error"]) for r in rows if "error" in r]
    # "validated", not "rows": the JSON answer's "rows" are the rows themselves
    return {"validated": len(errors),
            "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "max_abs_error": max(errors, default=None)}


def local_cluster(name: str | None, path: str | None, overrides: list[str]) -> Any:
    """The cluster `name` (default cpu_gloo), refused unless it describes this machine: the runs
    a prediction is checked against happen here, so another machine's prediction beside them
    measures the difference between the machines, not the prediction's error."""
    from dtlab.config import load_config
    from dtlab.config.device import device_type
    from dtlab.predict.cluster import known_clusters, load_cluster

    device = device_type(load_config(path, overrides))
    here = "cpu"
    if device == "cuda":
        import torch

        here = torch.cuda.get_device_name(0)
    cluster = load_cluster(name or "cpu_gloo")
    if describes(cluster.device, here):
        return cluster
    ours = [c for c in known_clusters() if describes(load_cluster(c).device, here)]
    given = f"--cluster {name}" if name else "the default cluster cpu_gloo"
    fix = (f"--cluster {' or '.join(ours)} (this machine)" if ours else
           f"--cluster FILE describing {here} (like configs/clusters/h100_sxm_8x.yaml)")
    if name:
        fix += f", or drop --validate to predict {name}"
    where = "this machine's CPU" if here == "cpu" else here
    what = "a CPU" if cluster.device == "cpu" else cluster.device
    raise ConfigError(f"--validate runs the strategies here, on {where}, and {given} describes "
                      f"{what}: its prediction beside these runs would measure the machines' "
                      f"difference; fix: {fix}")


def describes(cluster_device: str, here: str) -> bool:
    """A cluster's `device` is this machine's ("cpu", or a GPU name such as torch reports
    it): a CPU for a CPU, and a GPU of the model it names (H100, A100: the part a cluster file
    and the driver's name share; any GPU when it names none)."""
    if "cpu" in (cluster_device, here):
        return cluster_device == here
    model = re.search(r"\b[A-Z]\d{2,3}\b", cluster_device)
    return model is None or re.search(rf"\b{model.group()}\b", here) is not None


def cmd_validate(args: argparse.Namespace) -> int:
    from dtlab.estimate.cli import table

    cluster = local_cluster(args.cluster, args.config, list(args.overrides))
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
              f"{100 * total['max_abs_error']:.1f}% over {total['validated']} runs")
    for r in rows:
        if "skipped" in r:
            print(f"  ({r['strategy']} on {r['ranks']} ranks: skipped, {r['skipped']})")
    return 0
