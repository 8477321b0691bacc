"""One training step of one rank, traced: dtlab's own strategy class at the target world size,
under the recording fake process group (record.py), in this process.

The step is dtlab's (run/step.py's Stepper over the strategy's StepEngine): zero_grad, the
accumulation micro steps (gradients synchronised on the last one only), the gradient norm and the
optimizer step. On a real device untraced `warmup` steps come first, at least two (DDP rebuilds
its buckets in its second step's forward, with broadcasts a steady step does not make; optimizers
create their state), then one step with FLOPs counted, and one more, timed without the counting
(its Python dispatch would inflate small kernels), whose seconds are laid on the counted step's
Computes. On the meta device (a model too big to run here; fake_host.py) only the counted step,
after DDP's forwards and backwards and its bucket rebuild where the strategy has DDP: FLOPs, no
seconds. Collectives over a group of one rank move nothing: left out (Trace.meta["alone"]).
Trace.meta["state_bytes"]: the traced rank's parameter, gradient and optimizer bytes after the
step, the strategy's own `state_bytes` (what `dtlab estimate` measures), on either device.

Phases: `forward`/`backward` per block of `model.blocks()` (block None: embeddings, head, loss),
`recompute` (a checkpointed block's forward run again in its backward), `optimizer` (the gradient
norm, with clipping, and the step), `other` (zero_grad). `micro`: the accumulation micro step;
pipelines: micro step x microbatches + the schedule's microbatch. Compute.bytes: the bytes of
every op's tensor inputs and outputs, an upper bound of what a roofline needs (no cache reuse).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from dtlab.config import Config, check_world, model_parallel_size
from dtlab.config.strategies import registry
from dtlab.data import spec_for
from dtlab.errors import ConfigError
from dtlab.predict.counting import CountingMode
from dtlab.predict.events import Compute, Event, Issue, Trace
from dtlab.predict.fake_host import fake_reducers, host_mode, on_host
from dtlab.predict.record import BACKEND, recording_group
from dtlab.predict.recorder import RECORDER


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _first_tensor(value: Any) -> torch.Tensor | None:
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


class Places:
    """Hooks that move the recorder as the step goes through the blocks."""

    def __init__(self) -> None:
        self.tasks: set[int] = set()

    def backward_end(self) -> None:
        """Once per backward pass: at its end, DDP's bucket futures are needed."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self.tasks:
            return
        self.tasks.add(task)

        def ended() -> None:
            RECORDER.wait_futures()
            RECORDER.at("backward", None)
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def backward_of(self, i: int | None) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if RECORDER.on:
                self.backward_end()
                RECORDER.at("backward", i)
        return hook

    def block_done(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if RECORDER.on and RECORDER.block == i:
                RECORDER.at("backward", None)
        return hook

    def watch(self, blocks: list[nn.Module], recomputed: list[int]) -> None:
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(partial(self._pre, i), with_kwargs=True)
            block.register_forward_hook(partial(self._post, i))
            if i in recomputed and isinstance(block.forward, partial):  # see activation_checkpoint
                p = block.forward
                block.forward = partial(p.func, self._recompute(i, p.args[0]), *p.args[1:],
                                        **p.keywords)

    def _pre(self, i: int, _: nn.Module, args: Any, kwargs: Any) -> None:
        if not RECORDER.on:
            return
        RECORDER.at("recompute" if _in_backward() else "forward", i)
        x = _first_tensor((args, kwargs))
        if x is not None and not _in_backward():
            x.register_hook(self.block_done(i))

    def _post(self, i: int, _: nn.Module, __: Any, out: Any) -> None:
        if not RECORDER.on:
            return
        if _in_backward():
            RECORDER.at("backward", i)
            return
        RECORDER.at("forward", None)
        y = _first_tensor(out)
        if y is not None:
            y.register_hook(self.backward_of(i))

    def _recompute(self, i: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            if not (RECORDER.on and _in_backward()):
                return forward(*args, **kwargs)
            RECORDER.at("recompute", i)
            try:
                return forward(*args, **kwargs)
            finally:
                RECORDER.at("backward", i)
        return marked


class _NoSchedule:
    def step(self) -> None:
        pass


def _stepper(cfg: Config, engine: Any, places: Places) -> Any:
    """dtlab's Stepper over `engine`, its calls marking the phases; values are not judged."""
    from dtlab.run.step import Stepper

    class Tracing(Stepper):
        def finite(self, norm: torch.Tensor, step_loss: torch.Tensor) -> bool:
            return True

    micro = [0]
    zero_grad, micro_step, grad_norm, step = (engine.zero_grad, engine.micro_step,
                                              engine.grad_norm, engine.step)

    def traced_zero_grad() -> None:
        micro[0] = 0
        RECORDER.at("other", None, 0)
        zero_grad()

    def traced_micro_step(x: Any, y: Any, loss_hook: Any, sync: bool) -> Any:
        RECORDER.at("forward", None, micro[0])

        def hooked(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            report, root = loss_hook(loss)
            if root.requires_grad and RECORDER.on:
                root.register_hook(places.backward_of(None))
            return report, root
        try:
            return micro_step(x, y, hooked, sync)
        finally:
            RECORDER.wait_futures()
            micro[0] += 1

    def traced_grad_norm(clip: float) -> Any:
        RECORDER.at("optimizer", None)
        return grad_norm(clip)

    def traced_step() -> None:
        RECORDER.at("optimizer", None)
        step()

    engine.zero_grad, engine.micro_step = traced_zero_grad, traced_micro_step
    engine.grad_norm, engine.step = traced_grad_norm, traced_step
    if hasattr(engine, "schedule"):  # pipelines: the schedule's microbatch
        per = engine.pp.microbatches
        for stage in engine.pp.stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, _chunked(getattr(stage, name), micro, per))
    return Tracing(cfg, engine, _NoSchedule())


def _chunked(fn: Callable[..., Any], micro: list[int], per: int) -> Callable[..., Any]:
    def chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        RECORDER.at(RECORDER.phase if RECORDER.phase != "other" else "forward", RECORDER.block,
                    micro[0] * per + chunk_id)
        return fn(chunk_id, *args, **kwargs)
    return chunk


@contextmanager
def _threads(n: int) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    torch.set_flush_denormal(True)  # uninitialised memory (meta-built models) holds denormals
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


def _signature(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(type(e).__name__, e.phase, e.block, e.micro) if isinstance(e, Compute) else
            (type(e).__name__, e.op, e.bytes, e.group) if isinstance(e, Issue) else
            ("Wait", e.id) for e in events]


EMPTY_S = 20e-6  # a stretch without ops shorter than this is the tracer's own bookkeeping


def _kept(events: list[Event]) -> list[Event]:
    """Without the stretches that did nothing: no op counted and (timed) under EMPTY_S."""
    return [e for e in events if not isinstance(e, Compute) or e.flops or e.bytes
            or (e.seconds or 0.0) >= EMPTY_S]


def _timed_onto(counted: list[Event], timed: list[Event]) -> list[Event] | None:
    """The counted step's events with the timed step's seconds (None: the two differ)."""
    if _signature(counted) != _signature(timed):
        return None
    return [Compute(c.phase, c.block, t.seconds, c.flops, c.bytes, c.micro)
            if isinstance(c, Compute) and isinstance(t, Compute) else c
            for c, t in zip(counted, timed, strict=True)]


def _build(cfg: Config, device: torch.device) -> nn.Module:
    """The config's model on `device`; without weights on the meta device (its parameters fake
    host tensors: `host_mode`)."""
    from dtlab.estimate.measure import meta_model
    from dtlab.models import build_model

    if device.type == "meta":
        return on_host(meta_model(cfg))
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, spec_for(cfg), cfg.train.lora)


def trace_step(cfg: Config, world: int, rank: int, ranks_per_node: int, device: str = "meta",
               threads: int = 1, warmup: int = 1) -> Trace:
    """`rank`'s events of one step of `cfg`'s strategy at `world` ranks (module docstring)."""
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
        stepper = _stepper(cfg, engine, places)
        batches = [batch(spec, micro, dev, seed=i) for i in range(cfg.train.grad_accum_steps)]
        sync = ctx.synchronize
        if device == "meta":  # nothing to warm up but DDP's buckets (`fake_reducers`)
            rebuilds = fake_reducers(model, *getattr(strategy, "parts", ()))
            if rebuilds:  # the forwards and backwards give the order (no optimizer step)
                for i, (x, y) in enumerate(batches):
                    engine.micro_step(x, y, stepper.loss_hook, sync=i == len(batches) - 1)
                for ddp_module in rebuilds:
                    ddp_module._has_rebuilt_buckets = ddp_module.reducer._rebuild_buckets()
        else:
            for _ in range(max(2, warmup)):  # DDP rebuilds its buckets in its second forward
                stepper(batches)
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
            RECORDER.start(timed=True, sync=sync)
            stepper(batches)
            RECORDER.at("other", None)
            RECORDER.wait_all()
            merged = _timed_onto(events, RECORDER.stop())
            if merged is None:
                notes.append("the timed step's events differ from the counted one's: no seconds")
            else:
                events = merged
        events = _kept(events)
        state = strategy.state_bytes(model, optimizer)  # after the steps: the optimizer's state
    s = registry.of(cfg)
    label = s.label_of(strategy.describe()) if s.label else s.name
    meta: dict[str, object] = {
        "strategy": label, "device": device, "dtype": cfg.train.precision, "threads": threads,
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
    tensor parallel, whose ranks are symmetric); one rank per model-parallel coordinate of the
    first replica otherwise (pipelines: every stage, so that each send has its recv)."""
    check_world(cfg, world, ranks_per_node)
    if registry.of(cfg).distinct_ranks:  # mesh (dp, mp), row-major: ranks 0..mp-1
        return list(range(model_parallel_size(cfg, world)))
    return [0]


def collectives_of(trace: Trace) -> list[tuple[str, int, int]]:
    """(op, bytes, group size) of every Issue, in issue order."""
    return [(e.op, e.bytes, len(e.group)) for e in trace.events if isinstance(e, Issue)]

