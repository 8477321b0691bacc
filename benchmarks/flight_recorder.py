"""What the flight recorder costs: per collective, and per step of the quick config.

    python benchmarks/flight_recorder.py [--repeats 7] [--steps 200] [--strategies ddp fsdp]

1. Per collective: 2 gloo ranks run --ops all-reduces of one float with the recorder off and
   with dtlab's default buffer, in separate processes (PyTorch reads the buffer size once per
   process), A/B interleaved; the difference of the median per-op times is the recorder's cost
   per collective, which step time = collectives per step x that cost turns into a fraction.
2. Per step: the same training run with `run.flight_recorder=0` and with the default, A/B
   interleaved (the order alternates each repeat); the ratio on / off of the median step times
   (summary.json), pair by pair. On a 2-core machine a step varies by +-15% from run to run, so
   this only bounds the cost; part 1 measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dtlab.config import RunConfig

DEFAULT = RunConfig().flight_recorder


def step_time(run_dir: Path, strategy: str, steps: int, entries: int) -> float:
    cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", "2",
           f"strategy.name={strategy}", f"train.max_steps={steps}", "train.eval_every=0",
           "run.timing_warmup_steps=10", f"run.flight_recorder={entries}",
           f"run.dir={run_dir}", "run.progress=false", "resume=none", "run.overwrite=true"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())["median_step_time_s"]


def ops_worker(rank: int, store_path: str, entries: int, ops: int, out: str) -> None:
    import os
    import time

    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    t = torch.ones(1)
    for _ in range(200):  # warm-up
        dist.all_reduce(t)
    times = []
    for _ in range(ops // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(t)
        times.append((time.perf_counter() - t0) / 100)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    dist.destroy_process_group()


def per_op_seconds(tmp: Path, entries: int, ops: int) -> float:
    import torch.multiprocessing as mp

    store, out = tmp / f"store-{entries}", tmp / f"per_op-{entries}.json"
    store.unlink(missing_ok=True)
    mp.start_processes(ops_worker, args=(str(store), entries, ops, str(out)), nprocs=2,
                       start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--strategies", nargs="*", default=["ddp", "fsdp"],
                        help="training runs to compare (none: only the per-collective cost)")
    parser.add_argument("--ops", type=int, default=20000, help="all-reduces per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        on, off = interleaved(args.repeats, lambda n: per_op_seconds(Path(tmp), n, args.ops))
        costs = [a - b for a, b in zip(on, off, strict=True)]
        print(f"per collective (all-reduce of 1 float, 2 gloo ranks): off "
              f"{statistics.median(off) * 1e6:.1f} us, on {statistics.median(on) * 1e6:.1f} us; "
              f"on - off = median {statistics.median(costs) * 1e6:+.2f} us (range "
              f"{min(costs) * 1e6:+.2f} to {max(costs) * 1e6:+.2f} us, {args.repeats} pairs of "
              f"{args.ops} ops)", flush=True)
        for strategy in args.strategies:
            on, off = interleaved(args.repeats, lambda n, s=strategy: step_time(
                Path(tmp) / f"{s}-{n}", s, args.steps, n))
            ratios = [a / b for a, b in zip(on, off, strict=True)]
            print(f"{strategy}: median step {statistics.median(off) * 1e3:.2f} ms off, "
                  f"{statistics.median(on) * 1e3:.2f} ms with {DEFAULT} entries; on/off "
                  f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f} to "
                  f"{max(ratios):.3f}, {args.repeats} pairs)", flush=True)


def interleaved(repeats: int, measure: Callable[[int], float]) -> tuple[list[float], list[float]]:
    """measure(entries) with the recorder on and off, pair by pair, alternating which goes first."""
    on, off = [], []
    for i in range(repeats):
        order = [DEFAULT, 0] if i % 2 == 0 else [0, DEFAULT]
        t = {n: measure(n) for n in order}
        on.append(t[DEFAULT])
        off.append(t[0])
    return on, off


if __name__ == "__main__":
    main()
