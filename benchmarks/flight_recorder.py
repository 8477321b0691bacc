"""What the flight recorder costs a step: the same run with `run.flight_recorder=0` (off) and with
the default buffer, A/B interleaved (the order alternates each repeat), on the quick config.

    python benchmarks/flight_recorder.py [--repeats 7] [--steps 200] [--strategies ddp fsdp]

Each run reports its median step time after the warm-up steps (summary.json); the ratio
on / off is taken pair by pair, and its median and range are printed per strategy. A ratio whose
range straddles 1.00 is noise, not a cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dtlab.config import RunConfig

DEFAULT = RunConfig().flight_recorder


def step_time(run_dir: Path, strategy: str, steps: int, entries: int) -> float:
    cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", "2",
           f"strategy.name={strategy}", f"train.max_steps={steps}", "train.eval_every=0",
           "run.timing_warmup_steps=10", f"run.flight_recorder={entries}",
           f"run.dir={run_dir}", "run.progress=false", "resume=none"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())["median_step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies:
            ratios, on_s, off_s = [], [], []
            for i in range(args.repeats):
                order = [DEFAULT, 0] if i % 2 == 0 else [0, DEFAULT]
                t = {n: step_time(Path(tmp) / f"{strategy}-{n}", strategy, args.steps, n)
                     for n in order}
                ratios.append(t[DEFAULT] / t[0])
                on_s.append(t[DEFAULT])
                off_s.append(t[0])
            print(f"{strategy}: median step {statistics.median(off_s) * 1e3:.2f} ms off, "
                  f"{statistics.median(on_s) * 1e3:.2f} ms with {DEFAULT} entries; on/off "
                  f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f} to "
                  f"{max(ratios):.3f}, {args.repeats} pairs)", flush=True)


if __name__ == "__main__":
    main()
