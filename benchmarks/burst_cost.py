"""What does a collective cost when many are issued back to back, against what a cluster file's
link prices one at? The cluster files' `burst` factors (dtlab predict multiplies the price of
each call of such a run by them: ZeRO-1's parameter broadcasts, a run of DeepSpeed's gathers).

    python benchmarks/burst_cost.py [--world 2] [--ops broadcast,all_gather]
                                    [--config configs/tp_gpt.yaml] [--cluster cpu_gloo] [--json FILE]

`--world` gloo ranks on this machine (threads per rank: the cores over the ranks, at least 1).
The calls are one per parameter of the config's model, of its size, as ZeRO-1 issues them (its
broadcasts: each parameter from the rank that owns it, ZeroRedundancyOptimizer's partition,
rank after rank; gathers: each parameter's shards). Per op, two loops alternate `--rounds` times:
  alone   the calls, each waited for before the next is issued
  burst   the same calls issued asynchronously back to back, then waited for
The median over the ranks of each loop's time; factor = burst / the link's price of the calls
(the cluster file's fit for `--world` ranks, summed). The mix of sizes matters: measured here
with one size per burst, 4 KiB calls pipeline (0.4 x the price) and 64-256 KiB ones queue (4 x),
so the factor is measured on a model's own parameters. On this 2-core machine a burst costs more
than the fit at 2 ranks, and at 4 ranks (oversubscribed) far less than the fit's latency, which a
lone call pays in full waiting for its peers to be scheduled.

Run it on a quiet machine. On a GPU, NCCL's calls queue on a stream: not measured there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from gloo_ranks import run_ranks, save

ROOT = Path(__file__).resolve().parents[1]


def _owners(numels: list[int], world: int) -> list[int]:
    """The rank owning each parameter in ZeroRedundancyOptimizer's partition: largest first, each
    to the rank holding the fewest elements so far."""
    load, owner = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = load.index(min(load))
        load[owner[i]] += numels[i]
    return owner


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    result: dict[str, dict[str, list[float]]] = {}
    owner = _owners(args.numels, world)
    for op in args.ops:
        if op == "all_gather":
            bufs = [(torch.ones(-(-n // world)), torch.empty(-(-n // world) * world))
                    for n in args.numels]
        else:
            bufs = [(torch.ones(n), None) for n in args.numels]

        def call(i: int, wait: bool, bufs=bufs, op=op):  # noqa: ANN001, ANN202
            shard, full = bufs[i]
            if op == "all_gather":
                return dist.all_gather_into_tensor(full, shard, async_op=not wait)
            return dist.broadcast(shard, src=owner[i], async_op=not wait)

        order = sorted(range(len(bufs)), key=lambda i: owner[i])  # rank after rank

        def alone(order=order, call=call) -> None:  # noqa: ANN001
            for i in order:
                call(i, True)

        def burst(order=order, call=call) -> None:  # noqa: ANN001
            for h in [call(i, False) for i in order]:
                h.wait()

        def timed(body) -> float:  # noqa: ANN001 - a function of no arguments
            dist.barrier()
            t0 = time.perf_counter()
            body()
            return time.perf_counter() - t0

        burst()
        alone()  # warm-up: gloo's connections, the buffers' pages
        samples: dict[str, list[float]] = {"alone": [], "burst": []}
        for _ in range(args.rounds):
            samples["alone"].append(timed(alone))
            samples["burst"].append(timed(burst))
        result[op] = samples
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", type=lambda s: s.split(","), default=["broadcast", "all_gather"])
    p.add_argument("--config", default=str(ROOT / "configs/tp_gpt.yaml"),
                   help="the model whose parameters are the calls")
    p.add_argument("--rounds", type=int, default=15, help="times the two loops alternate")
    p.add_argument("--cluster", default="cpu_gloo", help="whose link prices a call")
    p.add_argument("--json", help="write the samples and the factors here")
    args = p.parse_args()

    import torch

    from dtlab.config import load_config
    from dtlab.estimate.core import meta_model
    from dtlab.predict.cluster import load_cluster
    from dtlab.predict.price import link_seconds

    args.numels = [p.numel() for p in meta_model(load_config(args.config, [])).parameters()]
    link = load_cluster(args.cluster).intra
    ranks, (load_before, load_after) = run_ranks(rank_main, args.world, args)
    rows, factors = [], {}
    for op in args.ops:
        med = {k: statistics.median(statistics.median(r[op][k]) for r in ranks)
               for k in ("alone", "burst")}
        sizes = [4 * n for n in args.numels] if op == "broadcast" else \
            [4 * -(-n // args.world) * args.world for n in args.numels]
        price = sum(link_seconds(link, op, size, args.world) for size in sizes)
        factors[op] = med["burst"] / price
        rows.append({"op": op, "calls": len(sizes), "bytes": sum(sizes), "alone_s": med["alone"],
                     "burst_s": med["burst"], "price_s": price, "factor": factors[op]})
        print(f"{op:>10}: {len(sizes)} calls, {sum(sizes) / 1e6:.2f} MB on {args.world} ranks: "
              f"one at a time {med['alone'] * 1e3:.2f} ms, in a burst {med['burst'] * 1e3:.2f} "
              f"ms; the link prices them at {price * 1e3:.2f} ms -> factor {factors[op]:.2f}")
    print(f"burst factors on {args.world} ranks: "
          + ", ".join(f"{op} {f:.2f}" for op, f in factors.items())
          + f" ({Path(args.config).name}'s parameters; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.2f} before, "
          f"{load_after:.2f} after)")
    save(args.json, args, (load_before, load_after), world=args.world, factors=factors,
         rows=rows, ranks=ranks)


if __name__ == "__main__":
    main()
