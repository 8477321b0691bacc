"""Can dtlab's communication numbers be trusted? Three cross-checks, 2 ranks.

    python benchmarks/comm_model.py [--json docs/results/comm_model.json]

1. The timing code of `dtlab comm` (its `timed` on its all_reduce case: back-to-back calls, slowest
   rank per iteration, median) against an independent plain torch.distributed loop, alternating
   in one job so that both see the same machine state: the ratio per size.
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


def interleaved(iters: int, repeats: int) -> None:
    """Worker: per size, alternate dtlab's timing code with a plain loop, `repeats` times each.

    Alternating inside one job makes both see the same machine state (this VM drifts by 10-50%
    between runs minutes apart at small sizes). The plain loop uses nothing from dtlab: back-to-back
    all-reduces, each timed, slowest rank per iteration."""

    import torch
    import torch.distributed as dist

    from dtlab.comm.bench import timed
    from dtlab.comm.ops import make_case
    from dtlab.distributed import distributed

    out = {}
    with distributed(need_group=True) as ctx:
        for size in SIZES:
            case = make_case("all_reduce", size // 4, torch.float32, ctx.device)
            x = torch.ones(size // 4)
            ours: list[float] = []
            theirs: list[float] = []
            for _ in range(repeats):
                ours += timed(case, case.in_place, iters, 3, ctx)  # what `dtlab comm` runs
                for _ in range(3):
                    dist.all_reduce(x)
                dist.barrier()
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    times.append(time.perf_counter() - t0)
                slowest = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                theirs += slowest.tolist()
            out[size] = {"dtlab_us": statistics.median(ours) * 1e6,
                         "plain_us": statistics.median(theirs) * 1e6,
                         "plain_mean_us": statistics.fmean(theirs) * 1e6}
    if ctx.rank == 0:
        print(json.dumps(out))


def run(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        interleaved(args.iters, args.repeats)
        return
    from dtlab.comm.model import fit, predict

    tmp = Path(tempfile.mkdtemp())
    dtlab = [sys.executable, "-m", "dtlab"]
    cross_raw = json.loads(run([sys.executable, "-m", "torch.distributed.run",
                                f"--nproc-per-node={RANKS}", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=127.0.0.1:0", str(Path(__file__).resolve()),
                                "--worker", "--iters", str(args.iters), "--repeats",
                                str(args.repeats)]).strip().splitlines()[-1])
    print(f"1. dtlab comm's timing vs a plain torch.distributed loop (all_reduce in place, {RANKS} "
          f"ranks, {args.repeats} x {args.iters} iterations each, alternating in one job)")
    print(f"{'size (B)':>12}{'dtlab (us)':>12}{'plain (us)':>12}{'ratio':>8}{'plain mean (us)':>17}")
    cross = []
    for size, v in cross_raw.items():
        ratio = v["dtlab_us"] / v["plain_us"]
        cross.append({"size_bytes": int(size), **v, "ratio": ratio})
        print(f"{size:>12}{v['dtlab_us']:>12.1f}{v['plain_us']:>12.1f}{ratio:>8.3f}"
              f"{v['plain_mean_us']:>17.1f}")

    run([*dtlab, "comm", "--op", "all_reduce", "--nproc-per-node", str(RANKS), "--min-bytes",
         str(SIZES[0]), "--max-bytes", str(SIZES[-1]), "--factor", "4", "--iters", str(args.iters),
         "--json", str(tmp / "comm.json")])
    rows = [r for r in json.loads((tmp / "comm.json").read_text()) if "size_bytes" in r]
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
        measured = b["by_op"]["all_reduce"]["seconds_per_step"]  # BN-buffer broadcasts apart
        ddp[name] = {"n_params": summary["n_params"], "buckets_bytes": buckets,
                     "measured_all_reduce_s": measured, "measured_all_collectives_s": b["comm_time_s"], "exposed_s": b["exposed_comm_s"],
                     "overlapped_s": b["overlapped_comm_s"], "step_s": b["step_time_s"],
                     "compute_s": b["compute_time_s"], "predicted_s": predicted,
                     "ratio": predicted / measured}
        print(f"  {name} ({summary['n_params']:,} parameters, buckets "
              f"{[round(s / 2**20, 2) for s in buckets]} MiB): step {b['step_time_s'] * 1e3:.1f} ms, "
              f"compute-only {b['compute_time_s'] * 1e3:.1f} ms, all collectives "
              f"{b['comm_time_s'] * 1e3:.2f} ms (exposed {b['exposed_comm_s'] * 1e3:.2f}, overlapped "
              f"{b['overlapped_comm_s'] * 1e3:.2f}), of which all-reduce {measured * 1e3:.2f} ms; "
              f"predicted all-reduce {predicted * 1e3:.2f} ms, ratio {predicted / measured:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"crosscheck": cross, "fit": model, "ddp": ddp},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
