"""The node's other ranks, running beside a traced one: compute is timed under the load a run puts
on the host, not alone.

Ranks of a CPU host that each have cores of their own still share its memory bandwidth and
caches: measured here, the GPT of configs/tp_gpt.yaml steps in 130 ms alone on one core and in
143-144 ms while a second process runs the same steps on the other core (+10%). So while the
traced rank runs, `beside` keeps as many other processes stepping the same rank's model as the
node has cores for beyond it (min(ranks per node, cores // threads) - 1); the sharing of cores
beyond that, when ranks outnumber them, is the simulator's (cores.py), not measured twice.

Where the node's ranks of one thread each outnumber its cores (4 ranks on 2 cores), all of its
other ranks step beside the traced one and its compute is read on its thread's CPU clock
(`cpu_clock`): a rank that shares a core with others is switched out and back in, and runs its
share with caches the others turned over. Measured here (2026-11-29, the quick CNN at 16
samples, 1 thread): a whole step takes 2.8-3.4 ms of CPU alone and 3.5 ms with 3 others stepping
on the 2 cores; its forward and backward alone take 4.6-5.2 ms of CPU in a 4-rank DDP run, where
the trace, on the wall clock beside one process, saw about 3.1 ms. The CPU clock leaves out the
time the rank waited for a core, which the simulator adds (its sharing of the cores), so it is
not counted twice.

Each helper is a separate process (spawned: nothing of this process's state is inherited) that
builds the step with trace.py's own code under the fake process group, runs two warm-up steps,
says so, and steps until told to stop. Their CPU time, start and exit included (the kernel's
account of the children this process reaped), is returned (`cpu_s`), so that the machine-load
check does not count them as other processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dtlab.config import Config
from dtlab.errors import DtlabError
from dtlab.process.launcher_guard import die_with_parent

READY_S = 300.0  # a helper that has not warmed up by then is broken, not slow


def cpu_clock(ranks_per_node: int, cores: int | None, threads: int) -> bool:
    """Whether a traced rank's compute is read on its thread's CPU clock (module docstring):
    ranks of one thread that outnumber the host's cores. With more threads a rank's work is not
    its own thread's CPU time, and the wall clock stays."""
    return cores is not None and threads == 1 and ranks_per_node > cores


def helpers_beside(ranks_per_node: int, cores: int | None, threads: int) -> int:
    """How many processes run beside a traced rank of a host with `cores` (None: a device per
    rank, none)."""
    if not cores:
        return 0
    if cpu_clock(ranks_per_node, cores, threads):
        return ranks_per_node - 1
    return max(0, min(ranks_per_node, cores // max(1, threads)) - 1)


def _helper(cfg: Config, world: int, rank: int, ranks_per_node: int, threads: int,
            warm: Any, stop: Any, parent: int) -> None:
    # A predict killed outright (SIGKILL, OOM) never sets `stop`: the kernel ends the helper.
    die_with_parent(parent)
    from dtlab.predict.trace import run_steps

    run_steps(cfg, world, rank, ranks_per_node, threads, warm.set, stop.is_set)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Beside:
    """The helpers' CPU seconds, known once the `beside` block has ended."""

    cpu_s: float = 0.0


@contextmanager
def beside(cfg: Config, world: int, rank: int, ranks_per_node: int, threads: int,
           count: int) -> Iterator[Beside]:
    """`count` processes stepping `rank`'s model while the block runs (module docstring)."""
    out = Beside()
    if count <= 0:
        yield out
        return
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    helpers = []
    reaped = _children_cpu_s()
    try:
        for _ in range(count):
            warm = ctx.Event()
            p = ctx.Process(target=_helper, args=(cfg, world, rank, ranks_per_node, threads,
                                                  warm, stop, os.getpid()), daemon=True)
            p.start()
            helpers.append((p, warm))
        deadline = time.monotonic() + READY_S
        for p, warm in helpers:
            while not warm.wait(0.2):
                if not p.is_alive() or time.monotonic() > deadline:
                    raise DtlabError(f"predict: a process stepping rank {rank}'s model beside the "
                                     f"traced one {'exited' if not p.is_alive() else 'hung'} "
                                     "before its warm-up ended; fix: run the same config with "
                                     "dtlab train to see its error")
        yield out
    finally:
        stop.set()
        for p, _ in helpers:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        out.cpu_s = _children_cpu_s() - reaped
