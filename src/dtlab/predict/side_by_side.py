"""Several strategies predicted at once, one forked process each, where nothing is timed.

A trace without values (the roofline: a GPU cluster predicted from this CPU, or a model too large
to run here) spends its seconds in Python dispatch: an 8B Llama at 64 ranks takes 6-8 s per
strategy on a 2-core host. The strategies' traces are independent of each other, so they run side
by side, one process per core. The processes are forked after the parent has imported what every
trace needs and counted the model's FLOPs once (a Llama's transformers import and FLOP count take
~6 s, which each spawned process would pay again). Nothing in such a trace is timed, so running
them together changes no number (tests/test_predict_cli.py compares the rows with a serial run);
a measured trace (--measure, --save-profile) is timed and runs alone, as does everything where
CUDA is initialised in this process (forking it is undefined) or one core is all there is.
The model-parallel strategies start first: DTensor's dispatch makes theirs the longest traces
(fsdp_tp@8x8: 15 of the 8B's 52 s of tracing here), and one started last would end alone.

Ctrl-C reaches the parent alone: it ends the children (and a SIGKILLed parent takes them along,
PR_SET_PDEATHSIG), and only it says the one line.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

from dtlab.errors import DtlabError
from dtlab.process.launcher_guard import die_with_parent

_REQUEST: Any = None  # the parent's Request, inherited by the forked children


def workers(req: Any, tokens: list[str], jobs: int | None = None) -> int:
    """How many processes predict `tokens` (1: here, one after the other): `jobs`, else one per
    core, at most one per token."""
    import torch

    if req.measure or len(tokens) < 2 or not hasattr(os, "fork") or torch.cuda.is_initialized():
        return 1
    return min(len(tokens), jobs or len(os.sched_getaffinity(0)))


def rows_side_by_side(req: Any, tokens: list[str], count: int) -> list[dict[str, Any]]:
    """predict(req, token) for every token, in order, in `count` forked processes. The first
    token's error (a ConfigError: a world the strategy cannot take) is raised as serial would
    raise it."""
    from dtlab.predict.core import model_flops, strategy_config

    global _REQUEST
    model_flops(strategy_config(req, tokens[0]))  # imports and FLOPs, shared by the forks
    order = sorted(range(len(tokens)), key=lambda i: -_model_parallel(req, tokens[i]))
    _REQUEST = req
    try:
        with mp.get_context("fork").Pool(count, initializer=_child) as pool:
            done = dict(zip(order, pool.imap(_predict, [tokens[i] for i in order]), strict=True))
    finally:
        _REQUEST = None
    rows = [done[i] for i in range(len(tokens))]
    for row in rows:
        if isinstance(row, DtlabError):
            raise row
    return rows


def _model_parallel(req: Any, token: str) -> int:
    """Ranks that share one copy of the model under `token` (0 where it cannot run)."""
    from dtlab.config import model_parallel_size
    from dtlab.predict.core import strategy_config

    try:
        return model_parallel_size(strategy_config(req, token), req.world)
    except DtlabError:
        return 0


def _child() -> None:
    import torch

    torch.set_num_threads(1)  # a trace without values computes nothing: no OpenMP after a fork
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops; it ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()


def _predict(token: str) -> dict[str, Any] | DtlabError:
    """The row, or the user's mistake it met (raised in token order by the parent)."""
    from dtlab.predict.core import predict

    try:
        return predict(_REQUEST, token)
    except DtlabError as e:
        return e
