"""How much slower does compute run while a collective is in flight? The cluster files'
`overlap_slowdown` (dtlab predict's simulator stretches compute that overlaps communication by
1 + this).

    python benchmarks/overlap_slowdown.py [--ranks 2] [--repeats 40] [--n 384] [--matmuls 8]
                                          [--bytes 64M] [--json FILE]

`--ranks` gloo ranks on this machine (threads per rank: the cores over the ranks, as dtlab gives
them; where ranks outnumber the cores, the block "alone" already runs with every rank computing
on the shared cores, so the slowdown is what the collectives add to that sharing).
Each rank times a block of `--matmuls` float32 n x n matrix multiplications, alone and while an
all_reduce of `--bytes` issued just before the block is still running (async_op=True: gloo works
in its own thread). Alone and overlapped samples alternate, so that drift in the machine's load
falls on both; an overlapped sample counts only if the all_reduce was still running when the
block ended (else the block did not overlap the whole time, and it is dropped and counted).
slowdown = median(overlapped) / median(alone) - 1, per rank, and the mean of the ranks.

On a CPU the slowdown is mostly the collective's thread (copies and reductions) taking cores
from the matmul. GPUs differ (NCCL's kernels take SMs and memory bandwidth): the GPU cluster
files carry the literature's value until this is measured there.
Run it on a quiet machine: other processes inflate both timings, not always alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from gloo_ranks import run_ranks, save


def _block(a, b, matmuls: int) -> float:  # noqa: ANN001 - torch tensors
    t0 = time.perf_counter()
    for _ in range(matmuls):
        a @ b
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    threads = max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=store, rank=rank,
                            world_size=world)
    a, b = torch.randn(args.n, args.n), torch.randn(args.n, args.n)
    buf = torch.ones(args.bytes // 4)
    for _ in range(3):  # warm-up: allocator, gloo's connections, the matmul's code paths
        _block(a, b, args.matmuls)
        dist.all_reduce(buf)
    alone, overlapped, dropped = [], [], 0
    for _ in range(args.repeats):
        dist.barrier()
        alone.append(_block(a, b, args.matmuls))
        dist.barrier()
        work = dist.all_reduce(buf, async_op=True)
        t = _block(a, b, args.matmuls)
        if work.is_completed():
            dropped += 1
        else:
            overlapped.append(t)
        work.wait()
    # the other side: the collective while the rank computes (small matmuls, to poll it often)
    c, d = torch.randn(args.poll_n, args.poll_n), torch.randn(args.poll_n, args.poll_n)
    comm = torch.ones(args.comm_bytes // 4)
    comm_alone, comm_overlapped = [], []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(comm)
        comm_alone.append(time.perf_counter() - t0)
        dist.barrier()
        t0, done = time.perf_counter(), None
        work = dist.all_reduce(comm, async_op=True)
        while done is None:
            c @ d
            if work.is_completed():
                done = time.perf_counter() - t0
        comm_overlapped.append(done)
    result = {"rank": rank, "threads": threads, "alone_s": alone, "overlapped_s": overlapped,
              "dropped": dropped, "comm_alone_s": comm_alone,
              "comm_overlapped_s": comm_overlapped}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks on this machine")
    p.add_argument("--repeats", type=int, default=40, help="samples of each kind per rank")
    p.add_argument("--n", type=int, default=384, help="matrix size of the compute block")
    p.add_argument("--matmuls", type=int, default=8, help="matrix multiplications per block")
    p.add_argument("--bytes", type=lambda s: int(float(s.rstrip("M")) * (1 << 20))
                   if s.endswith("M") else int(s), default=64 << 20,
                   help="all_reduce size in flight during the block (64M, or bytes)")
    p.add_argument("--comm-bytes", type=int, default=4 << 20,
                   help="all_reduce size timed alone and while the rank computes")
    p.add_argument("--poll-n", type=int, default=192,
                   help="matrix size of the compute that polls that all_reduce")
    p.add_argument("--json", help="write the raw samples and the result here")
    args = p.parse_args()

    import torch

    ranks, (load_before, load_after) = run_ranks(rank_main, args.ranks, args)
    per_rank = []
    for r in ranks:
        if not r["overlapped_s"]:
            raise SystemExit(f"rank {r['rank']}: the all_reduce finished before every block "
                             "ended; rerun with a larger --bytes or a smaller --matmuls")
        alone, over = statistics.median(r["alone_s"]), statistics.median(r["overlapped_s"])
        per_rank.append(over / alone - 1)
        print(f"rank {r['rank']} ({r['threads']} thread(s)): block alone {alone * 1e3:.2f} ms, "
              f"with an all_reduce in flight {over * 1e3:.2f} ms -> slowdown "
              f"{100 * (over / alone - 1):+.1f}% ({len(r['overlapped_s'])} overlapped samples, "
              f"{r['dropped']} dropped: the all_reduce had finished)")
    comm_per_rank = []
    for r in ranks:
        alone, over = statistics.median(r["comm_alone_s"]), statistics.median(r["comm_overlapped_s"])
        comm_per_rank.append(over / alone - 1)
        print(f"rank {r['rank']}: all_reduce of {args.comm_bytes} B alone {alone * 1e3:.2f} ms, "
              f"while it computes {over * 1e3:.2f} ms -> comm slowdown {100 * (over / alone - 1):+.1f}%")
    comm_slowdown = statistics.mean(comm_per_rank)
    print(f"comm_overlap_slowdown: {comm_slowdown:.3f} (mean of the ranks)")
    slowdown = statistics.mean(per_rank)
    print(f"overlap_slowdown: {slowdown:.3f} (mean of the ranks; {args.ranks} gloo ranks, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, load average {load_before:.2f} "
          f"before, {load_after:.2f} after)")
    save(args.json, args, (load_before, load_after), overlap_slowdown=slowdown,
         per_rank=per_rank, ranks=ranks, comm_overlap_slowdown=comm_slowdown,
         comm_per_rank=comm_per_rank)


if __name__ == "__main__":
    main()
