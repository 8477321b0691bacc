"""A cluster file for this CPU host, every number measured here now: what `cpu_gloo` ships, for
the machine you are on. Run it on a quiet machine (nothing else running: the script refuses to
call a measurement good when the load average says otherwise).

    python benchmarks/calibrate_cpu.py --out DIR [--quick]
    dtlab predict --cluster DIR/cluster.yaml ...   (or benchmarks/predict_vs_measured.py --cluster)

In order, each writing its JSON into DIR (3.5 min on 2 cores on 2026-11-28, and about 6 for step 5; --quick:
fewer iterations):
  1. `dtlab comm --op all` on 2 and on 4 local ranks, 4 bytes up: the links' alpha-beta fits from
     1 KiB up (smaller sizes priced as measured: LINE_FROM below); an op whose fit
     the fit's own checks refuse is left out of `fits:` (priced from all_reduce's), as cpu_gloo does
  2. benchmarks/sync_cost.py on 2 and 4 ranks: a collective's cost after the rank's own compute;
     on 4 ranks again with longer blocks (PHASE_MATMULS): the ranks' phase correlation per
     length of compute between two meetings (cores.py)
  3. benchmarks/burst_cost.py on 2 and 4 ranks: calls issued back to back, over the new fits' price
  4. benchmarks/overlap_slowdown.py: compute beside communication, and communication beside compute
  5. benchmarks/predict_vs_measured.py on a model held out from its matrix ("calib": ddp, fsdp and
     zero1 on 2 and 4 ranks, each side three times, in turn) with the file of steps 1-4: per
     number of ranks, the median of measured over predicted, less 1, is the file's step_overhead
     (what a real step takes beyond its simulation: gloo's threads on the ranks' cores, the
     wrappers' waits in their hooks, Python between the operators; docs/prediction.md)
Then DIR/cluster.yaml: the shipped cpu_gloo file with these numbers and their sources (date, load
average, file). The peak, cores and memory stay `measure`/`machine`: read when predicting.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src/dtlab/predict/clusters/cpu_gloo.yaml"
COMM = {2: ["--min-bytes", "4", "--max-bytes", "4M", "--factor", "16", "--iters", "30"],
        4: ["--min-bytes", "4", "--max-bytes", "64M", "--factor", "16", "--iters", "50"]}
# The line is fitted from 1 KiB up; 4 and 64 bytes are priced as measured: gloo's one-element
# all-reduce (a flag, a norm) costs a fraction of the line's latency (dtlab/comm/model.py)
LINE_FROM = 1024
# The ranks' phase correlation grows with the compute between their meetings: sync_cost.py's
# 4-rank step loop at blocks of about 2 (its default 6 matmuls, measured with the sync cost),
# 8, 31 and 125 ms of compute here, a point each for the cluster file's table
PHASE_MATMULS = (24, 96, 384)


def run(cmd: list[str], what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def fitted_ops(path: Path) -> list[str]:
    """The ops whose fit passes its checks (all_reduce among them, or the file is unusable)."""
    from dtlab.comm.model import fit_file

    fits = fit_file(path, LINE_FROM)
    kept = [op for op, m in fits.items() if not m["refused"]]
    if "all_reduce" not in kept:
        sys.exit(f"{path}: the all_reduce fit is refused ({fits['all_reduce']['refused']}); "
                 "fix: measure again on a quiet machine")
    return kept


def stamp(data: dict[str, Any], *paths: Path) -> str:
    load = data.get("load_average") or ["?", "?"]
    return (f"measured on this host by benchmarks/calibrate_cpu.py on {time.strftime('%Y-%m-%d')}"
            f" ({', '.join(p.name for p in paths)}; 1-min load average {load[0]:.2f} before, "
            f"{load[-1]:.2f} after, the calibration's own earlier steps included)")


# The held-out model's rows (benchmarks/predict_vs_measured.py: "calib"), per number of ranks
OVERHEAD_STRATEGIES, OVERHEAD_RANKS = "ddp,fsdp,zero1", (2, 4)


def overhead_by_ranks(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Per number of ranks, the median over the rows of measured / predicted - 1: what a real
    step takes beyond the simulated one. Below 0 (the prediction over the runs): 0."""
    import statistics

    by: dict[int, list[float]] = {}
    for r in rows:
        if "error" in r:
            by.setdefault(r["ranks"], []).append(r["measured_s"] / r["predicted_s"] - 1)
    return {n: round(max(0.0, statistics.median(v)), 3) for n, v in sorted(by.items())}


def step_overhead(out: Path, cluster: Path, quick: bool) -> dict[str, Any]:
    """Step 5 (module docstring): the cluster file's step_overhead and its source."""
    path = out / "step_overhead.json"
    run([sys.executable, "benchmarks/predict_vs_measured.py", "--configs", "calib",
         "--strategies", OVERHEAD_STRATEGIES, "--ranks", ",".join(map(str, OVERHEAD_RANKS)),
         "--variants", "base", "--interleave", "--fresh", "--no-collectives",
         *(["--runs", "2"] if quick else []), "--cluster", str(cluster), "--json", str(path)],
        "a real step beyond its simulation, on a model held out from the matrix")
    rows = json.loads(path.read_text())["rows"]
    overhead = overhead_by_ranks(rows)
    missing = [n for n in OVERHEAD_RANKS if n not in overhead]
    if missing:
        sys.exit(f"{path}: no row on {missing} ranks was predicted and run ("
                 + "; ".join(r.get("skipped", "") for r in rows) + "); fix: see that file")
    load = os.getloadavg()[0]
    return {"step_overhead": overhead, "step_overhead_source": (
        f"measured on this host by benchmarks/calibrate_cpu.py on {time.strftime('%Y-%m-%d')}: "
        f"the median over {OVERHEAD_STRATEGIES} of measured / predicted - 1 on a model held out "
        f"from benchmarks/predict_vs_measured.py's matrix ({path.name}; 1-min load average "
        f"{load:.2f} after)")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for the results and cluster.yaml")
    p.add_argument("--quick", action="store_true", help="fewer iterations: a rough file in ~5 min")
    p.add_argument("--allow-busy", action="store_true",
                   help="measure on a loaded machine anyway (its numbers are the load's)")
    args = p.parse_args()
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if load > 0.5 * cores and not args.allow_busy:
        print(f"calibrate_cpu.py: the machine is busy (load average {load:.2f} on {cores} cores): "
              "the numbers would be those of its other work; fix: stop it and run again, or "
              "--allow-busy", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    py, dtlab = sys.executable, [sys.executable, "-m", "dtlab"]
    spec = yaml.safe_load(SHIPPED.read_text())
    # The shipped file's overhead was measured against its own numbers: not these (step 5)
    spec.pop("step_overhead", None)
    spec.pop("step_overhead_source", None)

    results = []
    for world, flags in COMM.items():
        path = out / f"comm_{world}ranks.json"
        flags = [*flags[:-1], "10"] if args.quick else flags
        run([*dtlab, "comm", "--op", "all", "--nproc-per-node", str(world), *flags,
             "--json", str(path)], f"links, {world} ranks")
        results.append({"file": path.name, "fits": fitted_ops(path), "measured_below": LINE_FROM})
    spec["intra"]["comm_results"] = results
    spec["intra"].pop("fits", None)
    spec["intra"]["source"] = (f"dtlab comm on this host, {time.strftime('%Y-%m-%d')}: gloo ranks on "
                               "loopback, 2 ranks 4 B - 4 MiB, 4 ranks 4 B - 64 MiB, lines fitted from "
                               "1 KiB up, smaller sizes priced as measured (refused fits left out "
                               "of `fits`: priced from all_reduce's)")
    spec["inter"] = copy.deepcopy(spec["intra"])
    spec["inter"]["source"] = "no second host here: the same loopback fits as intra"
    cluster = out / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(spec, sort_keys=False, width=100))

    sync, burst = {}, {}
    repeats = ["--repeats", "20", "--rounds", "3"] if args.quick else []
    for world in (2, 4):
        path = out / f"sync_cost_{world}ranks.json"
        run([py, "benchmarks/sync_cost.py", "--world", str(world), *repeats, "--json", str(path)],
            f"sync cost, {world} ranks")
        data = json.loads(path.read_text())
        us = round(data["sync_s"] * 1e6)
        # Below zero: the noise is larger than the cost; withheld (0), and said so
        sync[world] = (max(us, 0), stamp(data, path) + ("" if us >= 0 else
                                                        f"; measured {us} us: noise, not used"))
    phase: dict[float, float] = {}
    phase_files, loads = [], []
    for matmuls in (None, *PHASE_MATMULS):
        path = out / ("sync_cost_4ranks.json" if matmuls is None
                      else f"phase_correlation_{matmuls}matmuls.json")
        if matmuls is not None:
            run([py, "benchmarks/sync_cost.py", "--world", "4", "--matmuls", str(matmuls),
                 "--sizes", "4K", "--repeats", "5" if args.quick else "10", "--rounds", "3",
                 "--json", str(path)], f"phase correlation, {matmuls} matmuls a block")
        data = json.loads(path.read_text())
        # below 0: ranks that take turns more than chance would, which cores.py does not model
        phase[round(data["block_alone_s"] * 1e3, 1)] = round(max(0.0, data["phase_correlation"]), 2)
        phase_files.append(path)
        loads += data["load_average"]
    spec["phase_correlation"] = phase
    spec["phase_correlation_source"] = (
        "per ms of compute between two meetings of the ranks, "
        + stamp({"load_average": [loads[0], loads[-1]]}, *phase_files))
    for world in (2, 4):
        path = out / f"burst_cost_{world}ranks.json"
        rounds = ["--rounds", "5"] if args.quick else []
        run([py, "benchmarks/burst_cost.py", "--world", str(world), "--cluster", str(cluster),
             *rounds, "--json", str(path)], f"burst factors, {world} ranks")
        data = json.loads(path.read_text())
        burst[world] = ({op: round(f, 2) for op, f in data["factors"].items()}, stamp(data, path))
    path = out / "overlap_slowdown.json"
    run([py, "benchmarks/overlap_slowdown.py", *(["--repeats", "15"] if args.quick else []),
         "--json", str(path)], "overlap slowdowns")
    overlap = json.loads(path.read_text())

    for key in ("intra", "inter"):
        link = spec[key]
        link["sync_us"] = {w: us for w, (us, _) in sync.items()}
        link["sync_source"] = "; ".join(f"{w} ranks: {s}" for w, (_, s) in sync.items())
        ops = sorted({op for factors, _ in burst.values() for op in factors})
        link["burst"] = {op: {w: f[op] for w, (f, _) in burst.items() if op in f} for op in ops}
        link["burst_source"] = "; ".join(f"{w} ranks: {s}" for w, (_, s) in burst.items())
    spec["overlap_slowdown"] = round(overlap["overlap_slowdown"], 2)
    spec["overlap_slowdown_source"] = stamp(overlap, path)
    spec["comm_overlap_slowdown"] = round(overlap["comm_overlap_slowdown"], 2)
    spec["comm_overlap_slowdown_source"] = stamp(overlap, path)
    header = (f"# This host, measured by benchmarks/calibrate_cpu.py on "
              f"{time.strftime('%Y-%m-%d %H:%M')} ({os.cpu_count()} cores).\n")
    cluster.write_text(header + yaml.safe_dump(spec, sort_keys=False, width=100))  # step 5 predicts with it
    spec.update(step_overhead(out, cluster, args.quick))
    cluster.write_text(header + yaml.safe_dump(spec, sort_keys=False, width=100))
    print(f"wrote {cluster}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
