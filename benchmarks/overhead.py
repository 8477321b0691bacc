"""How much does dtlab's loop cost? dtlab against minimal hand-written PyTorch loops.

    python benchmarks/overhead.py [--repeats 7] [--steps 300] [--pairs single,ddp] [--json results.json]

Two pairs, each run as separate processes, alternating which goes first in every repeat:
  - `dtlab train` (strategy single)       vs  a minimal single-process loop;
  - `dtlab train` (ddp, 2 local ranks)    vs  a minimal DDP script under torchrun.
Both sides train the same model (the quick config's CNN) on the same synthetic data held on the
device, with the same global batch, optimizer, threads per rank and timing rule: per-step wall
time after device synchronisation, the first `--warmup` steps excluded, samples/s = global batch /
median step. The ratio dtlab / minimal is reported per repeat, with its median and spread.

dtlab's figure is taken two ways: `step`, its summary's samples/s (the timed step: batch, forward,
backward, optimizer, schedule; what the minimal loop times too), and `loop`, the global batch over
its median step-boundary-to-step-boundary time (evaluations left out), which adds what dtlab does
between steps (logging, the progress file, the ranks' stop vote). The minimal loop has nothing
between steps, so its one figure stands against both. dtlab's own `loop_overhead_s` (the time per
step outside the engine's forward/backward and optimizer step) is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GLOBAL_BATCH = 64


def minimal_loop(steps: int, warmup: int) -> None:
    """The hand-written baseline: what a user writes without a framework (DDP if under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from dtlab.config import SyntheticConfig
    from dtlab.data.synthetic import synthetic_images
    from dtlab.distributed import cpus_available
    from dtlab.models import SimpleCNN

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.set_num_threads(max(1, cpus_available() // world))
    data, _ = synthetic_images(SyntheticConfig(), seed=0, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = SimpleCNN(channels=[16, 32], hidden=64)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    micro = GLOBAL_BATCH // world
    per_epoch = len(data) // GLOBAL_BATCH
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if step % per_epoch == 0:
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))
        start = (step % per_epoch) * GLOBAL_BATCH + rank * micro
        idx = order[start : start + micro]
        x, y = data.inputs[idx], data.targets[idx]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    timed = times[warmup:]
    if rank == 0:
        # dtlab's statistic (summary.json samples_per_s): the global batch over the median step
        print(json.dumps({"samples_per_s": GLOBAL_BATCH / statistics.median(timed)}), flush=True)
    if distributed:
        dist.destroy_process_group()


def run_minimal(nproc: int, steps: int, warmup: int) -> float:
    me = [str(Path(__file__).resolve()), "--minimal", "--steps", str(steps), "--warmup", str(warmup)]
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", *me]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def run_dtlab(nproc: int, steps: int, warmup: int) -> dict[str, float]:
    """dtlab's samples/s per step and per loop iteration, and its loop overhead per step."""
    with tempfile.TemporaryDirectory() as tmp:
        strategy = "single" if nproc == 1 else "ddp"
        subprocess.run(
            [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc),
             f"strategy.name={strategy}", f"train.max_steps={steps}", f"run.log_every={steps}",
             f"run.timing_warmup_steps={warmup}", "run.progress=false", f"run.dir={tmp}"],
            check=True, capture_output=True, text=True)
        s = json.loads((Path(tmp) / "summary.json").read_text())
        return {"step": s["samples_per_s"], "loop": GLOBAL_BATCH / s["median_loop_time_s"],
                "loop_overhead_s": s["loop_overhead_s"]}


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pairs", default="single,ddp", help="which pairs: single, ddp or both")
    p.add_argument("--json", help="write the raw measurements here")
    p.add_argument("--minimal", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.minimal:
        minimal_loop(args.steps, args.warmup)
        return
    import torch

    results = {"torch": torch.__version__, "cpus": os.cpu_count(), "steps": args.steps,
               "warmup": args.warmup, "global_batch": GLOBAL_BATCH, "pairs": {}}
    pairs = {"single": ("single vs minimal loop", 1), "ddp": ("ddp x2 vs minimal DDP script", 2)}
    for key in args.pairs.split(","):
        label, nproc = pairs[key]
        dtlab: list[dict[str, float]] = []
        minimal: list[float] = []
        for r in range(args.repeats):
            if r % 2 == 0:
                dtlab.append(run_dtlab(nproc, args.steps, args.warmup))
                minimal.append(run_minimal(nproc, args.steps, args.warmup))
            else:
                minimal.append(run_minimal(nproc, args.steps, args.warmup))
                dtlab.append(run_dtlab(nproc, args.steps, args.warmup))
        entry: dict[str, object] = {"minimal": minimal, "loop_overhead_s": [d["loop_overhead_s"] for d in dtlab]}
        print(f"{label}: minimal {spread(minimal)} samples/s")
        for kind in ("step", "loop"):
            values = [d[kind] for d in dtlab]
            ratios = [a / b for a, b in zip(values, minimal, strict=True)]
            entry[f"dtlab_{kind}"], entry[f"ratio_{kind}"] = values, ratios
            print(f"  dtlab ({kind}) {spread(values)} samples/s; ratio dtlab/minimal per repeat: "
                  f"{', '.join(f'{x:.3f}' for x in ratios)}")
            print(f"    ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
                  f"max {max(ratios):.3f}); median of dtlab / median of minimal "
                  f"{statistics.median(values) / statistics.median(minimal):.3f}")
        overhead = [d["loop_overhead_s"] * 1e3 for d in dtlab]
        print(f"  dtlab loop_overhead_s: median {statistics.median(overhead):.3f} ms per step "
              f"(min {min(overhead):.3f}, max {max(overhead):.3f})", flush=True)
        results["pairs"][label] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
