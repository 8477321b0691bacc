"""Start local workers through PyTorch's own launcher (torch elastic, the engine of `torchrun`).

Single node: c10d rendezvous on 127.0.0.1 with port 0, so the launcher picks a free port (no fixed
29500). Multi-node: give every node the same `--rdzv-endpoint HOST:PORT` and `--nnodes`. Note: the
rendezvous endpoint and MASTER_ADDR are loopback, but PyTorch's TCPStore server listens on all
interfaces whatever host it is given (measured with torch 2.13); firewall the node if that matters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator

from dtlab.distributed import cpus_available
from dtlab.process import interrupt
from dtlab.process.interrupt import STOP_SIGNALS
from dtlab.process.launcher_guard import launching
from dtlab.process.rendezvous import failure_line, waiting_said


def launch(
    worker_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "dtlab",
    max_restarts: int = 0,
    module: str = "dtlab.train",
    rdzv_conf: str = "",
) -> int:
    """Run `python -m <module> <worker_args>` on `nproc_per_node` local ranks; return an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    endpoint = rdzv_endpoint or "127.0.0.1:0"
    # Threads per rank = cores / local ranks; torchrun would otherwise force 1 and warn.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus_available() // nproc_per_node)))
    args = get_args_parser().parse_args([
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--max-restarts={max_restarts}",
        # The agent passes these on to every worker and waits for them to stop (dtlab/process/interrupt.py).
        f"--signals-to-handle={','.join(s.name for s in STOP_SIGNALS)}",
        *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
        "--module",
        module,
        *worker_args,
    ])
    # The workers print their own errors; the agent's log lines would repeat them as noise.
    # (torch sets a level on each module's logger: the parent's level alone does not reach them.)
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        # launching(): the workers die with this process, however it ends (launcher_guard.py).
        with _one_signal_stops_the_agent(), launching(), waiting_said(nnodes, endpoint):
            elastic_run(args)
    except ChildFailedError as e:
        return report_failures({rank: f.exitcode for rank, f in e.failures.items()})
    except interrupt.Interrupted as e:  # dtlab's handlers raise it; torch's take over with workers
        e.where = e.where or " before the workers started"
        raise
    except RendezvousError as e:  # the other nodes never came, or the endpoint is unreachable
        print(failure_line(e, nnodes, endpoint), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # the workers were stopped with it; rank 0 said where
        # A second signal cuts the agent's wait for its workers short: wait here, then SIGKILL.
        with interrupt.handling(), interrupt.forwarding():
            interrupt.stop_groups(interrupt.descendant_groups(os.getpid()), None, SHUTDOWN_S)
        return 128 + e.sigval
    return 0


SHUTDOWN_S = 30  # torch elastic's own wait for stopped workers before it SIGKILLs them


@contextlib.contextmanager
def _one_signal_stops_the_agent() -> Iterator[None]:
    """torch elastic's agent raises SignalException on every signal: a second one (Ctrl-C twice,
    or SLURM signalling every process of the job) would cut short its wait for the workers it is
    stopping, and it then SIGTERMs them again. Here the first signal raises it and later ones are
    passed on to the workers' process groups (a second Ctrl-C makes them stop at once)."""
    import torch.distributed.elastic.multiprocessing.api as elastic_api

    original = elastic_api._terminate_process_handler  # installed by PContext.start() by name
    first: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not first:
            first.append(signum)
            if not interrupt.children(os.getpid()):  # no worker to say where: say it here
                print(f"dtlab: interrupted by {interrupt.name(signum)} before the workers "
                      "started", file=sys.stderr, flush=True)
            original(signum, frame)  # raises SignalException
        for pid in interrupt.children(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)

    elastic_api._terminate_process_handler = handler
    try:
        yield
    finally:
        elastic_api._terminate_process_handler = original


def report_failures(exitcodes: dict[int, int]) -> int:
    """One line naming the rank that failed first-hand; returns the exit code to pass on.

    Ranks stopped by the agent (SIGTERM, or SIGKILL when they ignored it) are collateral: the cause
    is another rank's failure.
    (dtlab's workers turn SIGTERM into exit code 128 + 15 so that their cleanup runs.)
    """
    if all(c in interrupt.INTERRUPT_CODES for c in exitcodes.values()):
        return max(128 + abs(c) if c < 0 else c for c in exitcodes.values())  # rank 0 said where
    stopped = (-signal.SIGTERM, 128 + signal.SIGTERM)
    causes = {r: c for r, c in exitcodes.items() if c not in stopped} or exitcodes
    # A rank that ignored SIGTERM (busy in CUDA or NCCL set-up) is then SIGKILLed by the agent: a
    # rank that exited by itself is the cause (seen on an H100 with two ranks on one GPU).
    causes = {r: c for r, c in causes.items() if c > 0} or causes
    rank, code = min(causes.items())
    if code != 2:  # 2 = bad input, which the worker already explained in one line
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        others = sorted(set(exitcodes) - {rank})
        rest = f"; ranks {others} were stopped" if others else ""
        print(f"dtlab: error: worker rank {rank} failed with {how}{rest}", file=sys.stderr)
    return code if code > 0 else 128 - code  # killed by signal N -> 128 + N
