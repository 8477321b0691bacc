"""How steady this host's CPU is from one process to the next: the same compute, timed in fresh
processes one after another, nothing else running.

    python benchmarks/process_speed.py [--processes 24] [--threads 1] [--size 256] [--reps 40]
        [--json FILE]

Each process sets its torch threads, warms up, then times `--reps` rounds of 10 float32
matmuls of `--size` squared and prints the median round. On a steady machine the medians agree
within a few percent; where they do not, a process keeps the speed it got (the CPU it was
placed on, the hypervisor's share) for its whole life, and two runs of the same program differ
by that much however many steps each times. `dtlab predict` measures its compute in one
process and a run steps in others: their agreement is bounded by this spread
(docs/prediction.md, appendix: "The measurement's own spread").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dtlab.distributed import cpus_available

CHILD = """
import sys, time, torch
threads, size, reps = map(int, sys.argv[1:4])
torch.set_num_threads(threads)
a = torch.randn(size, size)
for _ in range(20):
    a @ a
rounds = []
for _ in range(reps):
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    rounds.append(time.perf_counter() - t)
print(sorted(rounds)[len(rounds) // 2])
"""


def one_process(threads: int, size: int, reps: int) -> float:
    """The median round's seconds in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(size), str(reps)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    medians = [one_process(a.threads, a.size, a.reps) for _ in range(a.processes)]
    mid = statistics.median(medians)
    q = statistics.quantiles(medians, n=10, method="inclusive")  # within the data, for any n
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": cpus_available(),
              "args": vars(a) | {"json": str(a.json) if a.json else None},
              "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
              "medians_ms": [round(m * 1e3, 3) for m in medians],
              "median_ms": mid * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3,
              "spread_p10_p90": (q[-1] - q[0]) / mid,
              "spread_min_max": (max(medians) - min(medians)) / mid}
    print(f"{a.processes} processes, {a.threads} thread(s), {a.size}^2 matmuls: median "
          f"{mid * 1e3:.2f} ms a round, p10-p90 {q[0] * 1e3:.2f}-{q[-1] * 1e3:.2f} ms "
          f"({100 * result['spread_p10_p90']:.0f}% of the median), min-max "
          f"{min(medians) * 1e3:.2f}-{max(medians) * 1e3:.2f} ms "
          f"({100 * result['spread_min_max']:.0f}%); 1-min load {load_before:.2f} before")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
