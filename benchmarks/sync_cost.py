"""What does a collective cost inside a step, beyond what it costs alone? The cluster files'
`sync_s` (dtlab predict adds it to every collective on a host whose ranks share its cores).

    python benchmarks/sync_cost.py [--world 2] [--repeats 60] [--n 256] [--matmuls 6]
                                   [--sizes 4K,1M] [--op all_gather] [--json FILE]

`--world` gloo ranks on this machine (threads per rank: the cores over the ranks, at least 1, as
dtlab gives them). Per size S, three loops of `--repeats` iterations each, timed as a whole:
  compute       a block of `--matmuls` float32 n x n multiplications (every rank at once)
  collective    the op on S bytes, back to back (what `dtlab comm` measures)
  step          the block, then the op (blocking): compute and communication as a step has them
sync = step - compute - collective, per iteration: what a collective costs once the ranks come
to it from their own compute (their arrival skew, the OS waking the waiting threads, caches
turned over by the compute), which the `dtlab comm` fit, measured back to back, does not see.
The median over the ranks of each loop's per-iteration time; the three loops alternate
`--rounds` times so that drift in the machine's load falls on all three.

On more than 2 ranks it also prints the ranks' phase correlation in the step loop: the Pearson
correlation of two ranks' "computing" indicators over time (each block timed on the host's
monotonic clock), the median over pairs, rounds and sizes. 1 is lockstep, what cores.py assumes
by default; it is what a cluster file's `phase_correlation` means. Measured here (4 ranks on 2
cores, 2026-11-28): 0.04 with the default blocks (2 ms of compute alone), 0.18 with 8 ms
(--matmuls 24), 0.33 with 31 ms (--matmuls 96). The short blocks ran mostly one rank at a
time, each at its speed alone (the four duty cycles summed to 1.04 on 2 cores), released one
after another from gloo's collective; longer blocks share the cores more (docs/prediction.md,
appendix: "The ranks' phase on shared cores").

Run it on a quiet machine. On a GPU the question is another (NCCL kernels queue behind the
compute on their own stream): not measured there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from gloo_ranks import run_ranks, save


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which both lists of disjoint, ordered spans cover the time."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def phase_correlation(spans: list[list[tuple[float, float]]]) -> float:
    """The Pearson correlation of two ranks' 'computing' indicators over the time all of them
    were in the loop, the median over the pairs of ranks: what cluster files call
    phase_correlation (dtlab/predict/cores.py). Where one rank computes, another computes with
    probability rho + (1 - rho) x its duty cycle."""
    start, end = max(s[0][0] for s in spans), min(s[-1][1] for s in spans)
    window = end - start
    clipped = [[(max(a, start), min(b, end)) for a, b in s if b > start and a < end] for s in spans]
    duty = [sum(b - a for a, b in s) / window for s in clipped]
    rhos = []
    for i in range(len(spans)):
        for j in range(i + 1, len(spans)):
            spread = (duty[i] * (1 - duty[i]) * duty[j] * (1 - duty[j])) ** 0.5
            if spread > 0:
                both = _overlap(clipped[i], clipped[j]) / window
                rhos.append((both - duty[i] * duty[j]) / spread)
    return statistics.median(rhos) if rhos else 1.0


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    threads = max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=store, rank=rank,
                            world_size=world)
    a, b = torch.randn(args.n, args.n), torch.randn(args.n, args.n)

    def block() -> None:
        for _ in range(args.matmuls):
            a @ b

    block()  # warm-up: the matmul's code paths
    alone = []  # the block with every other rank waiting: its length for phase_correlation
    for r in range(world):
        dist.barrier()
        if r == rank:
            for _ in range(5):
                t0 = time.perf_counter()
                block()
                alone.append(time.perf_counter() - t0)
    result: dict[str, dict[str, list[float]]] = {}
    for size in args.sizes:
        shard = torch.ones(max(1, size // 4 // world))
        full = torch.empty(shard.numel() * world)

        def op(full=full, shard=shard) -> None:  # noqa: ANN001 - this size's tensors
            if args.op == "all_gather":
                dist.all_gather_into_tensor(full, shard)
            else:
                dist.all_reduce(full)

        def loop(body) -> float:  # noqa: ANN001 - a function of no arguments
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                body()
            return (time.perf_counter() - t0) / args.repeats

        for _ in range(3):  # warm-up: allocator, gloo's connections, the matmul's code paths
            block()
            op()
        samples: dict[str, list[float]] = {"compute": [], "collective": [], "step": []}
        computing: list[list[tuple[float, float]]] = []  # per round: the step loop's blocks

        def timed_block(spans: list[tuple[float, float]]) -> None:
            t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
            block()
            spans.append((t0, time.monotonic()))

        for _ in range(args.rounds):
            samples["compute"].append(loop(block))
            samples["collective"].append(loop(op))
            spans: list[tuple[float, float]] = []
            samples["step"].append(loop(lambda spans=spans: (timed_block(spans), op())))
            computing.append(spans)
        result[str(size)] = {**samples, "computing": computing}
    Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, "threads": threads,
                                                 "block_alone_s": statistics.median(alone),
                                                 "samples": result}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=60, help="iterations per timed loop")
    p.add_argument("--rounds", type=int, default=5, help="times the three loops alternate")
    p.add_argument("--n", type=int, default=256, help="matrix size of the compute block")
    p.add_argument("--matmuls", type=int, default=6, help="matrix multiplications per block")
    p.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")],
                   default=[4 << 10, 1 << 20], help="collective sizes (nccl-tests bytes)")
    p.add_argument("--op", choices=["all_gather", "all_reduce"], default="all_gather")
    p.add_argument("--json", help="write the samples and the result here")
    args = p.parse_args()

    import torch

    ranks, (load_before, load_after) = run_ranks(rank_main, args.world, args)
    rows = []
    for size in args.sizes:
        med = {k: statistics.median(statistics.median(r["samples"][str(size)][k]) for r in ranks)
               for k in ("compute", "collective", "step")}
        sync = med["step"] - med["compute"] - med["collective"]
        rows.append({"size_bytes": size, **{f"{k}_s": v for k, v in med.items()}, "sync_s": sync})
        print(f"{args.op} {size:>9} B on {args.world} ranks ({ranks[0]['threads']} thread(s) "
              f"each): compute {med['compute'] * 1e3:.3f} ms, collective alone "
              f"{med['collective'] * 1e3:.3f} ms, step {med['step'] * 1e3:.3f} ms -> sync "
              f"{sync * 1e3:+.3f} ms per collective")
    sync_s = statistics.median(r["sync_s"] for r in rows)
    rho = statistics.median(
        phase_correlation([r["samples"][str(size)]["computing"][k] for r in ranks])
        for size in args.sizes for k in range(args.rounds)) if args.world > 2 else None
    alone_s = statistics.median(r["block_alone_s"] for r in ranks)
    if rho is not None:
        print(f"phase correlation of the ranks' compute in the step loop: {rho:.2f} (1: they "
              f"compute in lockstep; 0: independently), between meetings {alone_s * 1e3:.3g} ms "
              "of compute each (a block alone)")
    print(f"sync_s: {sync_s * 1e6:.0f} us (median over the sizes; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.2f} before, "
          f"{load_after:.2f} after)")
    save(args.json, args, (load_before, load_after), sync_s=sync_s, phase_correlation=rho,
         block_alone_s=alone_s, rows=rows, ranks=ranks)


if __name__ == "__main__":
    main()
