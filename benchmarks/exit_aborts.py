"""Why destroy the process group? Count the launches that abort at exit with and without it.

    python benchmarks/exit_aborts.py [--launches 60] [--strategy fsdp] [--json out.json]

Each launch is a short `dtlab train --nproc-per-node 2` (2 steps); the two variants alternate
launch by launch so that the machine's state affects both alike. A launch counts as aborted when
its exit code is not 0 or a worker printed "terminate called" (a C++ abort during interpreter
shutdown). The variant `lab.no_destroy_process_group=true` skips dtlab's gc.collect() and
destroy_process_group() at exit, as a script that forgets them would.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"destroyed": "false", "not_destroyed": "true"}


def launch(strategy: str, skip_destroy: str, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", "2",
           f"strategy.name={strategy}", "train.max_steps=2", "data.synthetic.train_samples=256",
           "data.synthetic.val_samples=64", "run.progress=false", f"run.dir={run_dir}",
           f"lab.no_destroy_process_group={skip_destroy}", "resume=none"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    aborted = proc.returncode != 0 or "terminate called" in proc.stderr
    return {"returncode": proc.returncode, "aborted": aborted, "seconds": time.perf_counter() - t0,
            "stderr_tail": proc.stderr[-300:] if aborted else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=60, help="launches per variant")
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.launches):
            for name, skip in VARIANTS.items():
                results[name].append(launch(args.strategy, skip, Path(tmp) / f"{name}-{i}"))
            counts = {n: sum(r["aborted"] for r in rs) for n, rs in results.items()}
            print(f"{i + 1}/{args.launches} launches per variant; aborted: {counts}", flush=True)
    summary = {
        "strategy": args.strategy, "launches_per_variant": args.launches,
        "aborted": {n: sum(r["aborted"] for r in rs) for n, rs in results.items()},
        "cpus": len(os.sched_getaffinity(0)), "launches": results,
    }
    for name, n in summary["aborted"].items():
        print(f"{name}: {n} of {args.launches} launches aborted at exit")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
