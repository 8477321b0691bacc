"""What a multi-node launch waits for, said while it waits: torch elastic's rendezvous prints
nothing until every node has joined or its join timeout (600 s by default) has passed.

While fewer nodes have joined the rendezvous's round than take part (before the first workers
start, and again before a restart's), a thread says after FIRST_S, then every EVERY_S, how many
nodes are missing at which endpoint and when the rendezvous gives up; and a rendezvous that gave
up or failed is one line (`failure_line`).

The count of nodes joined comes from the rendezvous handler's synced state (torch's own
`_state_holder`, refreshed by its join loop about every second); where a torch version lacks it,
the line says how many nodes take part instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from dtlab.process import interrupt

FIRST_S = 3.0  # nodes started together meet well within this: a wait beyond it is worth a line
EVERY_S = 30.0
POLL_S = 0.5


@contextlib.contextmanager
def waiting_said(nnodes: int, endpoint: str) -> Iterator[None]:
    """While torch elastic runs (inside elastic_run): the waiting lines of a launch of `nnodes`
    nodes, nothing for one node (its rendezvous is this process alone)."""
    if nnodes < 2:
        yield
        return
    import torch.distributed.elastic.rendezvous.registry as registry

    original = registry.get_rendezvous_handler  # called by name from torch's launch_agent
    handlers: list[Any] = []

    def capture(params: Any) -> Any:
        handler = original(params)
        handlers.append(handler)
        return handler

    done = threading.Event()
    watch = threading.Thread(target=_watch, args=(nnodes, endpoint, handlers, done),
                             daemon=True, name="dtlab-rendezvous-wait")
    registry.get_rendezvous_handler = capture
    watch.start()
    try:
        yield
    finally:
        done.set()
        registry.get_rendezvous_handler = original


def _watch(nnodes: int, endpoint: str, handlers: list[Any], done: threading.Event) -> None:
    since: float | None = None  # waiting since
    said: float | None = None
    while not done.wait(POLL_S):
        now, handler = time.monotonic(), handlers[-1] if handlers else None
        if not waiting(nnodes, handler):
            since = said = None
            continue
        since = since if since is not None else now
        if now < (since + FIRST_S if said is None else said + EVERY_S):
            continue
        line = waiting_line(nnodes, endpoint, handler, now - since)
        if not done.is_set():
            print(line, file=sys.stderr, flush=True)
            said = now


def waiting(nnodes: int, handler: Any) -> bool:
    """The rendezvous waits for nodes: fewer have joined its round than take part (without
    that count: no worker runs)."""
    joined = _joined(handler)
    if joined is not None:
        return joined < nnodes
    return not interrupt.children(os.getpid())


def waiting_line(nnodes: int, endpoint: str, handler: Any, waited_s: float) -> str:
    """The line for a rendezvous waited on for `waited_s`."""
    so_far = f"{int(waited_s)} s so far"
    if handler is None:  # torch is still connecting to the store at the endpoint
        host = endpoint.rpartition(":")[0]
        return (f"dtlab: waiting to reach the rendezvous at {endpoint} ({so_far}); start "
                f"`dtlab train --nnodes {nnodes} --rdzv-endpoint {endpoint}` on {host} too, "
                f"and check that it is reachable from here (nc -zv {host.strip('[]')} "
                f"{endpoint.rpartition(':')[2]})")
    joined = _joined(handler)
    missing = f"{nnodes - max(joined, 1)} of {nnodes} nodes" if joined is not None else \
        f"the other nodes ({nnodes} in all)"
    timeout = join_timeout_s(handler)
    gives_up = f"rendezvous timeout: {timeout:g} s" if timeout else "until the rendezvous timeout"
    return (f"dtlab: waiting for {missing} at {endpoint} ({so_far}, {gives_up}); start "
            f"`dtlab train --nnodes {nnodes} --rdzv-endpoint {endpoint}` with the same config "
            "on each of them")


def _joined(handler: Any) -> int | None:
    try:
        return len(handler._state_holder.state.participants)
    except Exception:  # another torch version, or no handler yet  # noqa: BLE001
        return None


def join_timeout_s(handler: Any) -> float | None:
    try:
        return handler.settings.timeout.join.total_seconds()
    except Exception:  # noqa: BLE001
        return None


def failure_line(error: BaseException, nnodes: int, endpoint: str | None) -> str:
    """The one line for a rendezvous that gave up (timeout) or could not be held."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(error, RendezvousTimeoutError):
        return (f"dtlab: error: the rendezvous at {endpoint} gave up: not all {nnodes} nodes "
                f"joined within its timeout; fix: start `dtlab train --nnodes {nnodes} "
                f"--rdzv-endpoint {endpoint}` on every node, or give them longer with "
                "--rdzv-conf join_timeout=SECONDS")
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    host, _, port = str(endpoint).rpartition(":")
    return (f"dtlab: error: the rendezvous at {endpoint} failed ({detail}); fix: check that "
            f"every node reaches it (nc -zv {host} {port}) and that {host} is one of the nodes")
