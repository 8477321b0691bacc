"""Where one traced step is: hooks on the model's blocks and on dtlab's step engine that move the
recorder (recorder.py) through phases (forward, backward, recompute, optimizer, other), blocks
and micro steps, as trace.py's docstring defines them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from dtlab.config import Config
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


def stepper(cfg: Config, engine: Any, places: Places) -> Any:
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
