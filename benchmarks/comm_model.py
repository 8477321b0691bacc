"""Can dtlab's communication numbers be trusted? Three cross-checks, 2 ranks.

    python benchmarks/comm_model.py [--json docs/results/comm_model.json]

1. `dtlab comm` (barrier, one all-reduce, slowest rank, median of iterations) against an
   independent plain torch.distributed loop (back-to-back all-reduces, no barrier, each timed,
   slowest rank, median; its mean shown too): the ratio per size.
2. The alpha-beta fit of `dtlab comm`'s all-reduce times: R^2.
3. A DDP training run with run.comm_breakdown=true: the communication time the profiler measured
   per step (exposed + overlapped; per step the rank that waited least, median over steps)
   against the model's prediction for the buckets DDP actually sent (sum over buckets of a + b S).
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

RANKS = 2
SIZES = [1 << k for k in range(12, 27, 2)]  # 4 KiB .. 64 MiB
DDP_MODELS = {  # about the same gradient size (11 MB), little and much compute
    "cnn-wide-head": ["model.channels=[4]", "model.hidden=2730", "train.global_batch_size=8"],
    "resnet18-w0.5": ["model.name=resnet", "model.width=0.5"],
}


def plain_loop(iters: int) -> None:
    """The independent baseline: nothing from dtlab, back-to-back all-reduces timed one by one
    (no barrier), slowest rank per iteration, median; plus the mean, as nccl-tests reports it."""
    import statistics

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for size in SIZES:
        x = torch.ones(size // 4)
        for _ in range(5):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[size] = {"median_us": statistics.median(slowest.tolist()) * 1e6,
                     "mean_us": statistics.fmean(slowest.tolist()) * 1e6}
    if dist.get_rank() == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def run(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain:
        plain_loop(args.iters)
        return
    from dtlab.comm.model import fit, predict

    tmp = Path(tempfile.mkdtemp())
    dtlab = [sys.executable, "-m", "dtlab"]
    ours: dict[int, list[float]] = {s: [] for s in SIZES}
    theirs: dict[int, list[float]] = {s: [] for s in SIZES}
    means: dict[int, list[float]] = {s: [] for s in SIZES}
    for repeat in range(args.repeats):  # alternate the two, so that drift hits both
        run([*dtlab, "comm", "--op", "all_reduce", "--nproc-per-node", str(RANKS), "--min-bytes",
             str(SIZES[0]), "--max-bytes", str(SIZES[-1]), "--factor", "4", "--iters",
             str(args.iters), "--json", str(tmp / f"comm{repeat}.json")])
        for r in json.loads((tmp / f"comm{repeat}.json").read_text()):
            if "size_bytes" in r:
                ours[r["size_bytes"]].append(r["ip"]["time_us"])
        plain = json.loads(run([sys.executable, "-m", "torch.distributed.run",
                                f"--nproc-per-node={RANKS}", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=127.0.0.1:0", str(Path(__file__).resolve()),
                                "--plain", "--iters", str(args.iters)]).strip().splitlines()[-1])
        for size, v in plain.items():
            theirs[int(size)].append(v["median_us"])
            means[int(size)].append(v["mean_us"])
    print(f"1. dtlab comm vs a plain torch.distributed loop (all_reduce in place, {RANKS} ranks, "
          f"{args.iters} iterations, median of {args.repeats} alternating runs)")
    print(f"{'size (B)':>12}{'dtlab (us)':>12}{'plain (us)':>12}{'ratio':>8}"
          f"{'dtlab spread':>14}{'plain spread':>14}{'plain mean (us)':>17}")
    cross = []
    for size in SIZES:
        a, b, m = (statistics.median(x[size]) for x in (ours, theirs, means))
        # How much each method varies from run to run by itself: (max - min) / median.
        sa = (max(ours[size]) - min(ours[size])) / a
        sb = (max(theirs[size]) - min(theirs[size])) / b
        cross.append({"size_bytes": size, "dtlab_us": a, "plain_median_us": b, "ratio": a / b,
                      "plain_mean_us": m, "dtlab_runs_us": ours[size], "plain_runs_us": theirs[size]})
        print(f"{size:>12}{a:>12.1f}{b:>12.1f}{a / b:>8.3f}{100 * sa:>13.0f}%{100 * sb:>13.0f}%"
              f"{m:>17.1f}")

    last = json.loads((tmp / f"comm{args.repeats - 1}.json").read_text())
    rows = [dict(r, time_us=statistics.median(ours[r["size_bytes"]])) for r in last if "size_bytes" in r]
    model = fit(rows)["all_reduce"]
    print(f"\n2. alpha-beta fit of all_reduce: a = {model['a_s'] * 1e6:.1f} us, "
          f"1/b = {1 / model['b_s_per_byte'] / 1e9:.3f} GB/s, R^2 = {model['r2']:.4f}")

    print("\n3. DDP: communication per step measured by the profiler vs predicted by the fit")
    ddp = {}
    for name, model_args in DDP_MODELS.items():
        run_dir = tmp / name
        run([*dtlab, "train", "--nproc-per-node", str(RANKS), "strategy.name=ddp", *model_args,
             "train.max_steps=4", "run.comm_breakdown=true", "run.breakdown_steps=12",
             f"run.dir={run_dir}", "run.progress=false"])
        summary = json.loads((run_dir / "summary.json").read_text())
        b = summary["comm_breakdown"]
        buckets = b["by_op"]["all_reduce"]["sizes"]  # DDP's buckets (broadcasts are BN buffers)
        predicted = sum(predict({"all_reduce": model}, "all_reduce", s, RANKS)["ring_s"]
                        for s in buckets)
        measured = b["comm_time_s"]
        ddp[name] = {"n_params": summary["n_params"], "buckets_bytes": buckets,
                     "measured_s": measured, "exposed_s": b["exposed_comm_s"],
                     "overlapped_s": b["overlapped_comm_s"], "step_s": b["step_time_s"],
                     "compute_s": b["compute_time_s"], "predicted_s": predicted,
                     "ratio": predicted / measured}
        print(f"  {name} ({summary['n_params']:,} parameters, buckets "
              f"{[round(s / 2**20, 2) for s in buckets]} MiB): step {b['step_time_s'] * 1e3:.1f} ms, "
              f"compute-only {b['compute_time_s'] * 1e3:.1f} ms, communication "
              f"{measured * 1e3:.2f} ms (exposed {b['exposed_comm_s'] * 1e3:.2f}, overlapped "
              f"{b['overlapped_comm_s'] * 1e3:.2f}); predicted {predicted * 1e3:.2f} ms, "
              f"ratio {predicted / measured:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"crosscheck": cross, "fit": model, "ddp": ddp},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
