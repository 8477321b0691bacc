"""`dtlab comm`: collective benchmarks in the format of nccl-tests, for any backend.

    dtlab comm --op all_reduce --min-bytes 8 --max-bytes 128M --nproc-per-node 2 --check
    torchrun --nproc_per_node=8 -m dtlab.comm.bench --op all --max-bytes 1G    # the same, by torchrun

Iterations run back to back after a barrier, each timed on its own (the device synchronised
after it). The time of a size is the slowest rank's time in each iteration (max over ranks),
median over iterations; min, max and p99 are kept. With --check the result of every element is
compared with its expected value and wrong elements are counted over all ranks.
"""

from __future__ import annotations

# ruff: noqa: E402 - a worker's signal handling starts before its imports (torch takes seconds)
if __name__ == "__main__":
    from dtlab.process.early_exit import exit_on_signals

    exit_on_signals()

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dtlab.comm.arguments import (  # noqa: F401 (parse_size: the benchmarks take it from here)
    DTYPE_NAMES,
    add_arguments,
    parse_size,
    validate,
)
from dtlab.comm.ops import (
    OPS,
    TYPE_NAMES,
    Case,
    busbw_factor,
    count_for,
    make_case,
    message_bytes,
)
from dtlab.comm.output import Progress, stopped, write_outputs
from dtlab.distributed import DistContext, detect_env, distributed, leave
from dtlab.errors import DtlabError
from dtlab.instruments.machine_load import LoadProbe, timing_record
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def sizes(lo: int, hi: int, factor: float) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s = max(int(s * factor), s + 1)
    return out


def timed(case: Case, call: Any, iters: int, warmup: int, ctx: DistContext) -> list[float]:
    # Back to back, as nccl-tests runs them: refilling inputs or a barrier between iterations
    # would add one rank's lag to the next measurement. (Values drift; --check runs apart.)
    case.prepare()
    for _ in range(warmup):
        call()
    ctx.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        ctx.synchronize()
        times.append(time.perf_counter() - t0)
    # The collective is as slow as its slowest rank: max over ranks, iteration by iteration.
    slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def count_wrong(case: Case, call: Any, in_place: bool, corrupt: bool, ctx: DistContext) -> int:
    case.prepare()
    call()
    ctx.synchronize()
    got = case.result(in_place)
    if corrupt:  # --corrupt-rank: a self-test that the checker catches a wrong element
        got.view(-1)[0] += 1
    wrong = 0 if case.expected is None else int((got != case.expected).sum().item())
    total = torch.tensor([wrong], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return int(total.item())


def stats(times: list[float], size: int, factor: float) -> dict[str, float]:
    ordered = sorted(times)
    median = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    algbw = size / median / 1e9
    return {"time_us": median * 1e6, "min_us": ordered[0] * 1e6, "max_us": ordered[-1] * 1e6,
            "p99_us": p99 * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * factor}


def measure(op: str, size: int, dtype: torch.dtype, args: argparse.Namespace,
            ctx: DistContext) -> dict[str, Any]:
    n = ctx.world_size
    type_size = torch.tensor([], dtype=dtype).element_size()
    count = count_for(op, size, type_size, n)
    s = message_bytes(op, count, type_size, n)
    case = make_case(op, count, dtype, ctx.device)
    row: dict[str, Any] = {"op": op, "world_size": n, "size_bytes": s, "count": count,
                           "type": TYPE_NAMES[dtype], "redop": case.redop, "root": case.root,
                           "backend": ctx.backend, "device": ctx.device.type}
    factor = busbw_factor(op, n)
    for name, call, in_place in (("oop", case.out_of_place, False), ("ip", case.in_place, True)):
        if call is None:
            continue
        row[name] = stats(timed(case, call, args.iters, args.warmup, ctx), s, factor)
        if args.check:
            row[name]["wrong"] = count_wrong(case, call, in_place, args.corrupt_rank == ctx.rank, ctx)
    best = row.get("ip") or row["oop"]  # the form training code calls (e.g. DDP's in-place)
    row["busbw_gbps"], row["time_us"] = best["busbw_gbps"], best["time_us"]
    return row


HEADER = ("#                                                    out-of-place"
          "                           in-place\n"
          "#        size       count      type   redop  root      time   algbw   busbw  #wrong"
          "      time   algbw   busbw  #wrong\n"
          "#         (B)  (elements)                              (us)  (GB/s)  (GB/s)        "
          "      (us)  (GB/s)  (GB/s)")


def format_row(row: dict[str, Any]) -> str:
    def part(v: dict[str, Any] | None) -> str:
        if v is None:
            return f"{'n/a':>10}{'':>8}{'':>8}{'':>8}"
        wrong = str(v.get("wrong", "-"))
        return f"{v['time_us']:10.1f}{v['algbw_gbps']:8.3f}{v['busbw_gbps']:8.3f}{wrong:>8}"

    return (f"{row['size_bytes']:13d}{row['count']:12d}{row['type']:>10}{row['redop']:>8}"
            f"{row['root']:6d}" + part(row.get("oop")) + part(row.get("ip")))


def run_benchmark(args: argparse.Namespace, ctx: DistContext,
                  progress: Progress | None = None) -> list[dict[str, Any]]:
    """Every measurement, then the machine's load while measuring; `progress` holds the rows
    measured so far, and what is being measured, for a stop by a signal."""
    probe = LoadProbe()
    progress = progress or Progress()
    rows = measure_all(args, ctx, progress)
    progress.doing = "the load record"
    timing = timing_record(probe, ctx.threads, ctx.gather_floats, {}, 0)
    rows.append({"op": "timing", **timing})  # the machine's load while measuring
    if timing["unreliable"] and ctx.is_main:
        print(f"# WARN: timings unreliable ({'; '.join(timing['unreliable'])}); rerun on an "
              "idle machine with ranks x threads <= cores", flush=True)
    return rows


def measure_all(args: argparse.Namespace, ctx: DistContext,
                progress: Progress) -> list[dict[str, Any]]:
    dtype = DTYPES[args.dtype]
    ops = list(OPS) if args.op == "all" else [args.op]
    rows = progress.rows  # filled as measured: a signal keeps what was measured before it
    say = print if ctx.is_main else (lambda *a, **k: None)
    say(f"# dtlab comm: {ctx.world_size} ranks, backend {ctx.backend} on {ctx.device.type}, "
        f"{args.iters} iterations after {args.warmup} warm-up; time = slowest rank, median")
    for op in ops:
        if op == "send_recv" and ctx.world_size < 2:
            say(f"# {op}: unsupported with 1 rank (needs a peer)")
            continue
        say(f"#\n# {op}\n{HEADER}")
        busbws, counts = [], set()
        type_size = torch.tensor([], dtype=dtype).element_size()
        for size in sizes(args.min_bytes, args.max_bytes, args.factor):
            count = count_for(op, size, type_size, ctx.world_size)
            if count in counts:  # rounds to a message already measured: one row per message
                continue
            counts.add(count)
            progress.doing = f"{op} of {size} B"
            try:
                row = measure(op, size, dtype, args, ctx)
            except (RuntimeError, NotImplementedError) as e:
                if interrupt.requested():  # a peer stopped by the same signal ended the collective
                    raise Interrupted(interrupt.requested() or 0) from None
                say(f"# {op}: unsupported by backend {ctx.backend}: {str(e).splitlines()[0][:200]}")
                rows.append({"op": op, "unsupported": str(e).splitlines()[0][:200]})
                break
            rows.append(row)
            busbws += [v["busbw_gbps"] for v in (row.get("oop"), row.get("ip")) if v]
            say(format_row(row), flush=True)
        if busbws:
            say(f"# Avg bus bandwidth    : {statistics.fmean(busbws):.4g}")
    if args.p2p and ctx.world_size > 1:
        progress.doing = "the point-to-point matrix"
        matrix = p2p_matrix(ctx, args.p2p_bytes, args.iters)
        rows.append({"op": "p2p_matrix", **matrix})
        say("#\n# point-to-point: one-way latency (us, 8 B) / bandwidth (GB/s, "
            f"{args.p2p_bytes} B), rank pairs, others idle")
        for i, line in enumerate(matrix["latency_us"]):
            say(f"# rank {i}: " + "  ".join(
                "        -" if i == j else f"{lat:7.1f}/{matrix['bandwidth_gbps'][i][j]:.3f}"
                for j, lat in enumerate(line)))
    return rows


def p2p_matrix(ctx: DistContext, nbytes: int, iters: int) -> dict[str, Any]:
    """Ping-pong between every pair of ranks in turn: one-way latency and bandwidth."""
    n, r = ctx.world_size, ctx.rank
    lat = torch.zeros(n, n, dtype=torch.float64)
    bw = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            for size, table in ((8, lat), (nbytes, bw)):
                buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=ctx.device)
                dist.barrier()
                if r in (i, j):
                    peer = j if r == i else i
                    first, then = (dist.send, dist.recv) if r == i else (dist.recv, dist.send)
                    times = []
                    for _ in range(iters + 2):
                        t0 = time.perf_counter()
                        first(buf, peer)
                        then(buf, peer)
                        ctx.synchronize()
                        times.append((time.perf_counter() - t0) / 2)
                    one_way = statistics.median(times[2:])
                    value = one_way * 1e6 if table is lat else buf.numel() * 4 / one_way / 1e9
                    table[i, j] = table[j, i] = value
    for table in (lat, bw):  # each entry was measured by its two ranks: take the larger
        t = table.to(ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        table.copy_(t.cpu())
    return {"latency_us": lat.tolist(), "bandwidth_gbps": bw.tolist(), "p2p_bytes": nbytes}


def measure_and_write(args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    try:
        with distributed(args.device, args.backend, args.timeout, need_group=True) as ctx:
            rows = run_benchmark(args, ctx, progress)
            if ctx.is_main:
                progress.doing = "writing the results"
                write_outputs(rows, args)
        return rows
    except RuntimeError:
        if interrupt.requested():  # a peer stopped by the same signal ended a collective here
            raise Interrupted(interrupt.requested() or 0) from None
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.comm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    progress, is_main = Progress(), detect_env().rank == 0
    # A signal stops every rank with one line from rank 0 and exit code 128 + its number; the
    # rows measured so far are written (dtlab/comm/output.py).
    with interrupt.handling():
        try:
            validate(args)
            rows = measure_and_write(args, progress)
        except DtlabError as e:
            print(f"dtlab: error: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:
            return stopped(e, progress, args, is_main)
    wrong = sum(v.get("wrong", 0) for r in rows for v in (r.get("oop"), r.get("ip")) if v)
    return 1 if wrong else 0


if __name__ == "__main__":
    leave(main())
