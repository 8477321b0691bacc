"""A collective smoke test: real processes, a real process group, values checked, a hard timeout.

The doctor hosts a TCPStore on 127.0.0.1 with a port the OS picks (port 0: no race, no fixed
port) and starts `python -m dtlab.doctor.smoke BACKEND RANK WORLD PORT TIMEOUT` once per rank.
Each rank runs all_reduce, all_gather and broadcast with known inputs, checks the results exactly,
times a 1 MiB all_reduce, destroys its process group, and prints one JSON line. Ranks still running
at the deadline are killed and the check fails: that is what a hang looks like.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from dtlab.doctor.check import Check, fail, ok, skip
from dtlab.process.launcher_guard import die_with_launcher, launcher_env

MARK = "dtlab-smoke "
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT")
TIMED_BYTES = 1 << 20


def checks(timeout_s: float, nproc: int) -> list[Check]:
    import torch
    import torch.distributed as dist

    result = [run("gloo", 2, timeout_s)]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2 and dist.is_nccl_available():
        result.append(run("nccl", max(2, min(nproc, gpus)), timeout_s))
    else:
        why = "nccl not in this build" if not dist.is_nccl_available() else f"{gpus} GPU(s)"
        result.append(skip("smoke_nccl", f"NCCL smoke test needs 2 GPUs ({why})"))
    return result


def child_env() -> dict[str, str]:
    """The caller's environment (NCCL_*, GLOO_SOCKET_IFNAME... are what we test) minus the launch
    variables of any surrounding job; one thread per rank; dtlab importable as imported here."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


START_UP_S = 2.0  # below this a --timeout cannot see the ranks start (0.8 s measured idle here)


def run(backend: str, world: int, timeout_s: float) -> Check:
    name = f"smoke_{backend}"
    start = time.monotonic()
    outputs, codes, pids = spawn(backend, world, timeout_s)
    seconds = time.monotonic() - start
    killed = [r for r, code in enumerate(codes) if code is None]
    reports = {r: _report(outputs[r], code) for r, code in enumerate(codes) if code is not None}
    by_error: dict[str, list[int]] = {}
    for r, rep in reports.items():
        if "error" in rep:  # drop the C++ source location gloo/NCCL put first
            by_error.setdefault(re.sub(r"^\[[^\]]*\]\s*", "", rep["error"]), []).append(r)
    errors = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {e}"
              for e, r in by_error.items()]
    if killed and timeout_s < START_UP_S:  # the deadline, not the machine, is what failed
        return fail(name, f"{backend}, {world} ranks: not finished after {timeout_s:g} s; "
                    f"killed rank(s) {killed}", f"--timeout {timeout_s:g} is shorter than starting "
                    f"{world} Python processes with torch takes (a second or more)",
                    "--timeout 60 (the default), or at least a few seconds", pids=pids,
                    killed=killed)
    if killed:
        return fail(name, f"{backend}, {world} ranks: not finished after {timeout_s:g} s; "
                    f"killed rank(s) {killed}" + "".join(f"; {e}" for e in errors),
                    "the ranks hang connecting or in a collective: a firewall dropping local "
                    "traffic, a wrong GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, or a machine so "
                    "loaded that start-up alone takes longer",
                    "rerun with TORCH_CPP_LOG_LEVEL=INFO (and NCCL_DEBUG=INFO for nccl) to see "
                    "where it waits; --timeout S on a slow machine", pids=pids, killed=killed)
    if errors:
        mismatch = any(rep.get("mismatch") for rep in reports.values())
        return fail(name, f"{backend}, {world} ranks: {'; '.join(errors)}",
                    "the backend returned wrong values: a broken build or faulty hardware"
                    if mismatch else "the ranks could not set up or run collectives: see the "
                    "message (connection errors point at the network settings checked above)",
                    "rerun with TORCH_CPP_LOG_LEVEL=INFO (and NCCL_DEBUG=INFO for nccl); fix the "
                    "failed checks above first", pids=pids, ranks=list(reports.values()))
    r0 = reports[0]
    return ok(name, f"{backend}, {world} ranks: all_reduce {r0['all_reduce']:g} (expected "
              f"{r0['all_reduce_expected']:g}), all_gather {r0['all_gather']}, broadcast "
              f"arange({r0['broadcast_n']}) exact; 1 MiB all_reduce {r0['ms']:.2f} ms median "
              f"({r0['busbw_gbps']:.2f} GB/s bus bandwidth); {seconds:.1f} s with start-up",
              pids=pids, ranks=list(reports.values()), seconds=seconds)


def spawn(backend: str, world: int,
          timeout_s: float) -> tuple[list[str], list[int | None], list[int]]:
    """Run the ranks; return each one's output, exit code (None: killed at the deadline) and pid."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    # The deadline below kills the ranks; the store's own timeout only bounds its waits, and
    # under a millisecond (--timeout 1e-9) it fails to start at all, with a C++ trace
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    procs: list[subprocess.Popen] = []
    killed: set[int] = set()
    with ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world)]
        try:
            for rank, log in enumerate(logs):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dtlab.doctor.smoke", backend, str(rank), str(world),
                     str(store.port), str(timeout_s)], stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=launcher_env(child_env()), text=True))
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:  # whatever happened, no rank outlives the check
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    killed.add(rank)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    del store
    codes = [None if r in killed else p.returncode for r, p in enumerate(procs)]
    return outputs, codes, [p.pid for p in procs]


def _report(output: str, returncode: int) -> dict:
    lines = [line for line in output.splitlines() if line.startswith(MARK)]
    if lines:
        return json.loads(lines[-1][len(MARK):])
    last = (output.strip().splitlines() or ["no output"])[-1][:200]
    return {"error": f"exited with code {returncode} without a result ({last})"}


# ---- one rank (runs in the child process) ------------------------------------------------------
class Mismatch(Exception):
    pass


def _expect(what: str, got: list[float], expected: list[float]) -> None:
    if got != expected:
        raise Mismatch(f"{what} gave {got}, expected {expected}")


def collectives(rank: int, world: int, device) -> dict:  # noqa: ANN001 (torch.device)
    import torch
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    total = world * (world + 1) / 2
    _expect("all_reduce", t.tolist(), [total] * 4)
    parts = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=device))
    _expect("all_gather", [p.tolist() for p in parts], [[float(r)] * 2 for r in range(world)])
    b = torch.arange(8.0, device=device) if rank == 0 else torch.zeros(8, device=device)
    dist.broadcast(b, src=0)
    _expect("broadcast", b.tolist(), [float(i) for i in range(8)])
    x = torch.zeros(TIMED_BYTES // 4, device=device)
    times = []
    for i in range(7):  # 2 warm-up rounds, 5 timed; each waits for the device before the next
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"all_reduce": t[0].item(), "all_reduce_expected": total,
            "all_gather": [int(p[0].item()) for p in parts], "broadcast_n": 8, "ms": seconds * 1e3,
            # bus bandwidth as nccl-tests defines it: a ring all-reduce moves 2(n-1)/n of the data
            "busbw_gbps": 2 * (world - 1) / world * TIMED_BYTES / seconds / 1e9}


def main(argv: list[str]) -> int:
    backend, (rank, world, port), timeout_s = argv[0], map(int, argv[1:4]), float(argv[4])
    report: dict = {"rank": rank, "pid": os.getpid()}
    try:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
        try:
            report.update(collectives(rank, world, device))
        finally:
            dist.destroy_process_group()
    except Exception as e:  # reported by the parent as one line  # noqa: BLE001
        report["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        report["mismatch"] = isinstance(e, Mismatch)
    print(MARK + json.dumps(report), flush=True)
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    die_with_launcher()  # a rank ends with the doctor, however the doctor ends
    code = main(sys.argv[1:])  # its report is printed and flushed
    os._exit(code)  # no interpreter teardown after a process group: see distributed.leave()
