"""Start a command's ranks as real processes, cheaply: `ranks.train(...)` does what
`dtlab train --nproc-per-node N ...` does, minus the torch elastic agent and the interpreter
start-up.

The ranks are forked from a multiprocessing forkserver that imported torch and dtlab once per
pytest worker: a rank starts in ~0.3 s instead of ~4 s of imports (a fresh interpreter per rank,
plus one for the agent, is what dominates a test's 2-rank run). Each rank runs the worker's own
entry point, `dtlab.train.run` (validate, join a real gloo process group through env://, train,
destroy the group, exit through distributed.leave), with the variables a launcher exports; when
a rank fails the others are stopped (SIGTERM, then SIGKILL) and the exit code is chosen by
dtlab's own `launch.report_failures`, as `dtlab train` does after torch elastic.

Launcher behaviour itself (elastic restarts, the agent's rendezvous, torchrun, SLURM) is tested
through the real commands: tests/test_reliability.py, tests/test_slurm.py, the guide.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab.process.launch import launch as real_launch

# Imported once by the forkserver, before it forks any rank (what every rank needs; optimizers
# import torch._dynamo on first use, the slowest part of a rank's start); forkserver_init last.
PRELOAD = ["dtlab.train", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.nn.parallel", "safetensors.torch", "forkserver_init"]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def ensure_forkserver() -> None:
    """Start this process's forkserver (once) with tests/ on its module path: Python 3.11's
    forkserver imports its preload modules before it applies the parent's sys.path."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    tests = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, before] if before else [tests])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _rank(target: Callable[[list[str]], int], argv: list[str], environ: dict[str, str], cwd: str,
          out: str, err: str) -> None:
    """One rank: the caller's environment and directory, its own output files, then target(argv)
    and distributed.leave(code), as `python -m dtlab.train` ends."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    from dtlab.distributed import leave

    leave(target(argv))


def _train_main(argv: list[str]) -> int:
    from dtlab.train import main

    return main(argv)


def _comm_main(argv: list[str]) -> int:
    from dtlab.comm.bench import main

    return main(argv)


# The worker modules dtlab launches, and their entry points (what `python -m MODULE` runs).
MAINS: dict[str, Callable[[list[str]], int]] = {"dtlab.train": _train_main,
                                                "dtlab.comm.bench": _comm_main}


def start(nproc: int, argv: list[str], target: Callable[[list[str]], int] = _train_main,
          env: dict[str, str] | None = None, timeout: float = 300,
          grace_s: float = 30) -> subprocess.CompletedProcess[str]:
    """Run target(argv) on `nproc` ranks (1 rank: no launch variables, as a 1-rank `dtlab train`
    runs). Returns the exit code (dtlab's launcher rules) and the ranks' output, rank by rank."""
    from dtlab.process.launch import report_failures

    ensure_forkserver()
    store = stores(1)[0] if nproc > 1 else None
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = []
        for rank in range(nproc):
            environ = {**os.environ, **(env or {})}
            if nproc > 1:
                environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(store.port),
                            # every rank a client of `store` (torchrun's agent hosts it alike)
                            "TORCHELASTIC_USE_AGENT_STORE": "True"}
                # what dtlab's launch() exports: threads per rank = cores / local ranks
                threads = max(1, len(os.sched_getaffinity(0)) // nproc)
                environ.setdefault("OMP_NUM_THREADS", str(threads))
            p = _CTX.Process(target=_rank, args=(target, argv, environ, os.getcwd(),
                                                  f"{logs}/{rank}.out", f"{logs}/{rank}.err"))
            p.start()
            procs.append(p)
        stopped = _wait(procs, timeout, grace_s)
        codes = {rank: p.exitcode for rank, p in enumerate(procs)}

        def read(name: str) -> str:  # absent: the rank failed before it reached _rank
            path = Path(logs, name)
            return path.read_text(errors="replace") if path.exists() else ""

        stdout = "".join(read(f"{r}.out") for r in codes)
        stderr = ""
        for r, c in codes.items():
            err = read(f"{r}.err")
            # a rank that failed before its output files existed says so; one stopped because
            # another failed may not have reached them yet (how far depends on the machine's speed)
            silent = not err and c and r not in stopped
            stderr += f"[rank {r}: exit {c} before its output was set up]\n" if silent else err
    code = 0
    if any(codes.values()):
        with contextlib.redirect_stderr(io.StringIO()) as said:
            code = report_failures(codes)
        stderr += said.getvalue()
    return subprocess.CompletedProcess([f"{nproc} ranks", *argv], code, stdout, stderr)


def _wait(procs: list[multiprocessing.process.BaseProcess], timeout: float,
          grace_s: float) -> set[int]:
    """Until all ranks exit; once one fails (or the timeout passes), SIGTERM the others, SIGKILL
    after grace_s (torch elastic's rule). Returns the ranks it stopped."""
    deadline = time.monotonic() + timeout
    stopped: set[int] = set()
    while any(p.exitcode is None for p in procs):
        failed = any(p.exitcode for p in procs)
        if failed or time.monotonic() > deadline:
            stopped = {r for r, p in enumerate(procs) if p.exitcode is None}
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for p in procs:
                    if p.exitcode is None:
                        os.kill(p.pid, sig)
                stop_by = time.monotonic() + grace_s
                while any(p.exitcode is None for p in procs) and time.monotonic() < stop_by:
                    time.sleep(0.05)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return stopped


def memoize_synthetic_images() -> None:
    """Generate each synthetic data set once per process: dtlab.data.synthetic_images and
    synthetic_tokens are pure functions of their arguments (config, seed, sizes, device), and
    making them is a large part of a short test run's rank (the quick config's 5,120 images:
    1.1 s; the GPT configs' 8,704 sequences: 0.4 s); forkserver_init makes the common ones
    before forking. Each call returns new dataset objects over the same (never modified)
    tensors."""
    import dtlab.data
    from dtlab.data.arrays import ArrayDataset

    def memoized(real: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(real, "memoized", False):
            return real
        made: dict[str, tuple[ArrayDataset, ArrayDataset]] = {}

        def make(cfg, seed, *rest):  # dtlab's signatures: (cfg, seed, [vocab, seq_len,] device)
            key = repr((cfg.model_dump_json(), seed, *(str(r) for r in rest)))
            if key not in made:
                made[key] = real(cfg, seed, *rest)
            return tuple(ArrayDataset(d.inputs, d.targets, d.transform) for d in made[key])

        make.memoized = True
        return make

    dtlab.data.synthetic_images = memoized(dtlab.data.synthetic_images)  # what build_datasets calls
    dtlab.data.synthetic_tokens = memoized(dtlab.data.synthetic_tokens)


def stores(n: int) -> list[Any]:
    """`n` rendezvous stores for the ranks (their MASTER_PORT: `.port`), served from this process
    on ports the kernel picks as it binds; keep them referenced while the ranks run. A port found
    free and handed to rank 0 to bind later could be taken meanwhile (the other pytest workers'
    ranks open listening sockets all the time): seen as "TCP client failed to connect ...
    Connection reset by peer" with 3 workers."""
    from torch.distributed import TCPStore

    return [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(n)]


def launch(worker_args: list[str], nproc_per_node: int, nnodes: int = 1,
           rdzv_endpoint: str | None = None, rdzv_id: str = "dtlab", max_restarts: int = 0,
           module: str = "dtlab.train", rdzv_conf: str = "") -> int:
    """dtlab.process.launch.launch's stand-in (same signature): one node without restarts on ranks from
    here (their output to this process's stdout/stderr); anything else through the real one."""
    if nnodes > 1 or max_restarts or rdzv_endpoint or module not in MAINS:
        return real_launch(worker_args, nproc_per_node, nnodes, rdzv_endpoint, rdzv_id,
                           max_restarts, module, rdzv_conf)
    proc = start(nproc_per_node, list(worker_args), target=MAINS[module])
    print(proc.stdout, end="", flush=True)
    print(proc.stderr, end="", file=sys.stderr, flush=True)
    return proc.returncode


def train(nproc: int, *args: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`dtlab train --nproc-per-node NPROC ARGS` (ARGS: --config FILE and overrides)."""
    return start(nproc, list(args), env=env, timeout=timeout)


if __name__ == "__main__":  # python tests/ranks.py NPROC [--config FILE] OVERRIDES...
    proc = train(int(sys.argv[1]), *sys.argv[2:])
    print(proc.stdout + proc.stderr, end="")
    sys.exit(proc.returncode)
