"""How many CPU-seconds does a gloo collective take from a host's cores? Not yet a term of
dtlab predict (predict/cores.py says so): measured for the floor a node's CPU work puts under a
step whose ranks outnumber the cores (docs/prediction.md, appendix: "4 ranks on 2 cores").

    python benchmarks/comm_cpu.py [--world 4] [--ops all_reduce,all_gather,...]
                                  [--sizes 4K,64K,512K,4M,16M] [--iters 20] [--rounds 3]
                                  [--json FILE]

`--world` gloo ranks on this machine (threads per rank: the cores over the ranks, at least 1,
as dtlab gives them). Each op is dtlab comm's (dtlab/comm/ops.py: the same calls, buffers and
nccl-tests sizes), issued `--iters` times back to back between two barriers, `--rounds` times.
A rank's CPU time (time.process_time: every thread of the process, user and system, so gloo's
own threads and the kernel's copies through loopback count) over the calls, per call; the
mean over the ranks (the node's CPU per call / ranks), the median over the rounds. Beside it,
the wall time per call and the cores the ranks kept busy meanwhile (CPU / wall, summed).

On a CPU a collective is work on the host's cores, not only a wait: measured here (2026-11-29)
a 547 KB all_reduce of 4 ranks on 2 cores takes about 2 ms of CPU on each rank, half its time
back to back. Where the ranks outnumber the cores, that CPU comes out of the compute's share.

Prints the table and, as one line of JSON, {ranks: {op: {bytes: CPU us per call per rank}}}.
Run it on a quiet machine: other processes' CPU is not counted, but they slow the calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from gloo_ranks import run_ranks, save

from dtlab.comm.bench import parse_size  # dtlab comm's sizes: 4K, 1M, ...

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
SIZES = "4K,64K,512K,4M,16M"


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from dtlab.comm.ops import count_for, make_case

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    result: dict[str, dict[str, list[list[float]]]] = {}
    for op in args.ops:
        for size in args.sizes:
            case = make_case(op, count_for(op, size, 4, world), torch.float32, torch.device("cpu"))
            call = case.in_place or case.out_of_place
            assert call is not None
            case.prepare()
            for _ in range(3):  # warm-up: gloo's connections, the buffers' pages
                call()
            samples = []
            for _ in range(args.rounds):
                dist.barrier()
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(args.iters):
                    call()
                samples.append([(time.process_time() - c0) / args.iters,
                                (time.perf_counter() - w0) / args.iters])
            result.setdefault(op, {})[str(size)] = samples
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def summarize(ranks: list[dict], ops: list[str], sizes: list[int]) -> list[dict]:
    """Per op and size: CPU per call per rank (the ranks' mean, the rounds' median), wall per call
    (the ranks' median, the rounds' median) and the cores busy meanwhile."""
    rows = []
    for op in ops:
        for size in sizes:
            rounds = len(ranks[0][op][str(size)])
            cpu = statistics.median(statistics.mean(r[op][str(size)][i][0] for r in ranks)
                                    for i in range(rounds))
            wall = statistics.median(statistics.median(r[op][str(size)][i][1] for r in ranks)
                                     for i in range(rounds))
            rows.append({"op": op, "bytes": size, "cpu_us": cpu * 1e6, "wall_us": wall * 1e6,
                         "cores_busy": cpu * len(ranks) / wall if wall > 0 else None})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ops", type=lambda s: s.split(","), default=OPS)
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[parse_size(x) for x in SIZES.split(",")],
                   help="nccl-tests sizes, as dtlab comm takes them (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="calls back to back per sample")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the rows, each rank's samples and the block here")
    args = p.parse_args()

    import torch

    ranks, (load_before, load_after) = run_ranks(rank_main, args.world, args)
    rows = summarize(ranks, args.ops, args.sizes)
    print(f"{'op':>15} {'bytes':>10} {'CPU us/rank':>12} {'wall us':>10} {'cores busy':>10}")
    for r in rows:
        print(f"{r['op']:>15} {r['bytes']:>10} {r['cpu_us']:>12.0f} {r['wall_us']:>10.0f} "
              f"{r['cores_busy']:>10.2f}")
    block = {args.world: {op: {r["bytes"]: round(r["cpu_us"]) for r in rows if r["op"] == op}
                          for op in args.ops}}
    print(json.dumps(block))
    print(f"({args.world} gloo ranks, torch {torch.__version__}, {os.cpu_count()} CPUs, load "
          f"average {load_before:.2f} before, {load_after:.2f} after)")
    save(args.json, args, (load_before, load_after), world=args.world, rows=rows, cpu_us=block,
         ranks=ranks)


if __name__ == "__main__":
    main()
