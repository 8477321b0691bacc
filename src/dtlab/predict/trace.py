"""One training step of one rank, traced: dtlab's own strategy class at the target world size,
under the recording fake process group (record.py), in this process.

The step is dtlab's (run/step.py's Stepper over the strategy's StepEngine): zero_grad, the
accumulation micro steps (gradients synchronised on the last one only), the gradient norm and the
optimizer step. On a real device untraced `warmup` steps come first, at least two (DDP rebuilds
its buckets in its second step's forward, with broadcasts a steady step does not make; optimizers
create their state) and at least WARMUP_S of them (a small model's first steps are slower than its
steady ones, as a run's first steps are, which its median leaves out), then one step with FLOPs
counted, and one more, timed without the counting
(its Python dispatch would inflate small kernels), whose seconds are laid on the counted step's
Computes. On the meta device (a model too big to run here; fake_host.py) only the counted step,
after DDP's forwards and backwards and its bucket rebuild where the strategy has DDP, and the
strategy's own `trace_warmup` steps (its registry entry): FLOPs, no seconds. Collectives over a
group of one rank move nothing: left out (Trace.meta["alone"]).
Trace.meta["state_bytes"]: the traced rank's parameter, gradient and optimizer bytes after the
step, the strategy's own `state_bytes` (what `dtlab estimate` measures), on either device.

Phases: `forward`/`backward` per block of `model.blocks()` (block None: embeddings, head, loss),
`recompute` (a checkpointed block's forward run again in its backward), `optimizer` (the gradient
norm, with clipping, and the step), `other` (zero_grad). `micro`: the accumulation micro step;
pipelines: micro step x microbatches + the schedule's microbatch. Compute.bytes: the bytes of
every op's tensor inputs and outputs, an upper bound of what a roofline needs (no cache reuse);
views and uninitialised allocations move none.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.config import Config, check_world, model_parallel_size
from dtlab.config.strategies import registry
from dtlab.data import spec_for
from dtlab.errors import ConfigError
from dtlab.predict.counting import CountingMode
from dtlab.predict.events import CPU_CLOCK, Compute, Event, Issue, Trace, mark_arrivals
from dtlab.predict.fake_host import fake_reducers, host_mode, on_host
from dtlab.predict.places import Places, stepper
from dtlab.predict.record import BACKEND, recording_group
from dtlab.predict.recorder import RECORDER


@contextmanager
def _threads(n: int) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    torch.set_flush_denormal(True)  # uninitialised memory (meta-built models) holds denormals
    try:
        _steady_heap()
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


@functools.cache  # once: glibc cannot go back to its own adjustment
def _steady_heap() -> None:
    """glibc keeps the memory freed at the top of its heap, and serves blocks up to 32 MiB from
    the heap, as it ends up doing in a long training run.

    Its defaults hand that memory back to the OS after each step of a short trace, and every
    step then faults its pages in again: measured here, the CNN of configs/quick.yaml timed at
    15-16 ms a step that a `dtlab train` process runs in 12.2 ms, and 11.6-12.1 ms with the heap
    kept (docs/prediction.md). Setting either threshold stops glibc's own adjustment of both, so
    both are set, once, for the rest of this process. Elsewhere (another libc) nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest (64-bit)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


def _signature(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(type(e).__name__, e.phase, e.block, e.micro) if isinstance(e, Compute) else
            (type(e).__name__, e.op, e.bytes, e.group) if isinstance(e, Issue) else
            ("Wait", e.id) for e in events]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
TIMED_STEPS = int(os.environ.get("DTLAB_TIMED_STEPS", "3"))  # each stretch: the median
# Measured here (2026-11-29): the quick CNN's compute, 7.5 ms a step timed after 2 warm-up steps
# (8.5 ms at the first timed step, 7.1-7.4 from about the fifteenth), 7.2-7.4 ms after 15; a GPT
# of 80 ms a step is steady after 2 (1.5% slower at the first). 0.15 s: the CNN's 15-20 steps,
# the GPT's 2.
WARMUP_S = 0.15
EMPTY_S = 20e-6  # a stretch without ops shorter than this is the tracer's own bookkeeping


def _kept(events: list[Event]) -> list[Event]:
    """Without the stretches that did nothing: no op counted and (timed) under EMPTY_S."""
    return [e for e in events if not isinstance(e, Compute) or e.flops or e.bytes
            or (e.seconds or 0.0) >= EMPTY_S]


def _timed_onto(counted: list[Event], timed: list[list[Event]]) -> list[Event] | None:
    """The counted step's events with each stretch's median seconds over the timed steps (None:
    a timed step's events differ from the counted one's)."""
    if any(_signature(counted) != _signature(t) for t in timed):
        return None
    return [Compute(c.phase, c.block, statistics.median(t[i].seconds for t in timed), c.flops,
                    c.bytes, c.micro) if isinstance(c, Compute) else c
            for i, c in enumerate(counted)]


def _build(cfg: Config, device: torch.device) -> nn.Module:
    """The config's model on `device`; without weights on the meta device (its parameters fake
    host tensors: `host_mode`)."""
    from dtlab.estimate.measure import meta_model
    from dtlab.models import build_model

    if device.type == "meta":
        return on_host(meta_model(cfg))
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, spec_for(cfg), cfg.train.lora)


@dataclass
class _Rank:
    """One rank's step, built in this process under the recording group."""

    strategy: Any
    model: nn.Module
    optimizer: Any
    engine: Any
    stepper: Any
    batches: list[Any]
    sync: Callable[[], None]
    n_params: int
    micro: int  # the micro batch per rank


@contextmanager
def _rank_step(cfg: Config, world: int, rank: int, ranks_per_node: int, device: str,
               threads: int) -> Iterator[_Rank]:
    """`rank`'s model, wrapped by its strategy at `world` ranks, and its step over one batch per
    micro step; ConfigError where the strategy cannot take that world or rank."""
    from dtlab.distributed import DistContext, DistEnv
    from dtlab.estimate.measure import batch
    from dtlab.levers import activation_checkpoint
    from dtlab.models import count_params, memory_format
    from dtlab.strategies import build

    if cfg.train.compile != "none":
        raise ConfigError(f"train.compile={cfg.train.compile} cannot be traced (the compiled "
                          "step is another program); fix: predict with train.compile=none")
    micro = check_world(cfg, world, ranks_per_node)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not one of the {world} ranks; fix: 0..{world - 1}")
    spec = spec_for(cfg)
    places = Places()
    with _threads(threads), recording_group(rank, world), host_mode(device) as dev, \
            contextlib.ExitStack() as stack:
        env = DistEnv(rank, rank % ranks_per_node, world, ranks_per_node, launcher="env")
        ctx = DistContext(env, dev, BACKEND, threads)
        strategy = build(cfg, ctx)
        stack.enter_context(strategy.in_one_process())
        model = _build(cfg, torch.device(device))
        n_params = count_params(model)
        memory_format.apply(model, cfg.model, dev, weights=not strategy.contiguous_params)
        recomputed = activation_checkpoint.apply(model, cfg.train.activation_checkpointing,
                                                 cfg.train.ac_every)
        places.watch(model.blocks(), recomputed)
        model, optimizer = strategy.setup(model)
        engine = strategy.step_engine(model, model, optimizer)
        yield _Rank(strategy, model, optimizer, engine, stepper(cfg, engine, places),
                    [batch(spec, micro, dev, seed=i) for i in range(cfg.train.grad_accum_steps)],
                    ctx.synchronize, n_params, micro)


def run_steps(cfg: Config, world: int, rank: int, ranks_per_node: int, threads: int,
              warm: Callable[[], None], stop: Callable[[], bool]) -> None:
    """`rank`'s steps on this CPU, untraced, until `stop()`; `warm()` after the first two: the
    load a node's other ranks put on the cores and memory beside a traced rank (corun.py)."""
    with _rank_step(cfg, world, rank, ranks_per_node, "cpu", threads) as r:
        for _ in range(2):
            r.stepper(r.batches)
        warm()
        while not stop():
            r.stepper(r.batches)


def trace_step(cfg: Config, world: int, rank: int, ranks_per_node: int, device: str = "meta",
               threads: int = 1, warmup: int = 1, cpu_clock: bool = False) -> Trace:
    """`rank`'s events of one step of `cfg`'s strategy at `world` ranks (module docstring);
    cpu_clock: time its compute on this thread's CPU clock, not the wall's (corun.cpu_clock)."""
    with _rank_step(cfg, world, rank, ranks_per_node, device, threads) as r:
        strategy, model, optimizer, engine = r.strategy, r.model, r.optimizer, r.engine
        stepper, batches, sync, n_params, micro = r.stepper, r.batches, r.sync, r.n_params, r.micro
        if device == "meta":  # DDP's buckets (`fake_reducers`) and the strategy's trace_warmup
            for _ in range(registry.of(cfg).trace_warmup):
                stepper(batches)
            rebuilds = fake_reducers(model, *getattr(strategy, "parts", ()))
            if rebuilds:  # the forwards and backwards give the order (no optimizer step)
                for i, (x, y) in enumerate(batches):
                    engine.micro_step(x, y, stepper.loss_hook, sync=i == len(batches) - 1)
                for ddp_module in rebuilds:
                    ddp_module._has_rebuilt_buckets = ddp_module.reducer._rebuild_buckets()
        else:
            began, steps = time.perf_counter(), 0  # DDP rebuilds its buckets in its 2nd forward
            while steps < max(2, warmup) or time.perf_counter() - began < WARMUP_S:
                stepper(batches)
                sync()
                steps += 1
        RECORDER.start(timed=False, sync=sync)
        with CountingMode(fake=device == "meta"):
            stepper(batches)
            RECORDER.at("other", None)
            RECORDER.wait_all()
        events, alone = RECORDER.stop(), RECORDER.alone
        notes: list[str] = []
        if alone:
            notes.append(f"{alone} collective(s) over a group of one rank, which move nothing, "
                         "left out")
        if device != "meta":
            timed = []
            for _ in range(TIMED_STEPS):
                RECORDER.start(timed=True, sync=sync,
                               clock=time.thread_time if cpu_clock else time.perf_counter)
                stepper(batches)
                RECORDER.at("other", None)
                RECORDER.wait_all()
                timed.append(RECORDER.stop())
            merged = _timed_onto(events, timed)
            if merged is None:
                notes.append("the timed steps' events differ from the counted one's: no seconds")
            else:
                events = merged
        events = mark_arrivals(_kept(events))
        state = strategy.state_bytes(model, optimizer)  # after the steps: the optimizer's state
    s = registry.of(cfg)
    label = s.label_of(strategy.describe()) if s.label else s.name
    meta: dict[str, object] = {
        "strategy": label, "device": device, "dtype": cfg.train.precision, "threads": threads,
        "clock": CPU_CLOCK if cpu_clock and device != "meta" else "wall",
        "world": world, "ranks_per_node": ranks_per_node, "micro_batch": micro,
        "grad_accum": cfg.train.grad_accum_steps, "torch": torch.__version__,
        "model": cfg.model.name, "n_params": n_params,
        "model_parallel": model_parallel_size(cfg, world), "alone": alone,
        "state_bytes": {k: int(v) for k, v in state.items()}}
    if notes:
        meta["notes"] = notes
    return Trace(rank, world, events, meta)


def traced_ranks(cfg: Config, world: int, ranks_per_node: int) -> list[int]:
    """The ranks the simulator needs: rank 0 when every rank does the same (data parallel, and
    tensor parallel, whose ranks are symmetric); the ranks the strategy's description names
    otherwise (pipelines: every stage of the first replica, so that each send has its recv)."""
    check_world(cfg, world, ranks_per_node)
    distinct = registry.of(cfg).distinct_ranks
    return distinct(cfg, world) if distinct is not None else [0]


def collectives_of(trace: Trace) -> list[tuple[str, int, int]]:
    """(op, bytes, group size) of every Issue, in issue order."""
    return [(e.op, e.bytes, len(e.group)) for e in trace.events if isinstance(e, Issue)]

