"""The strategy interface: everything the training loop needs to know about a parallelism.

A strategy wraps the model and builds the optimizer over what the wrapped model holds (its
shards), in one call (`setup`); says which data-parallel replica this rank belongs to (the data
loaders deal batches by it); runs one micro batch's forward and backward; keeps gradients local on
accumulation micro steps (`no_sync`); computes (and clips) the global gradient norm for its layout;
picks the autocast/grad-scaler pair for the precision; reduces metrics over the replicas;
evaluates; and produces state dicts.

The step itself is dtlab/run/step.py's: it drives a `StepEngine`, by default the one below, over the
strategy's pieces. Strategies that own the whole forward/backward of a step (pipeline schedules,
DeepSpeed's engine) return their own engine from `step_engine`, the one branch in the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from dtlab.config import Config
from dtlab.data import EvalLoader
from dtlab.distributed import DistContext
from dtlab.levers.optim import build_optimizer
from dtlab.models import loss_fn
from dtlab.strategies import grad_norm
from dtlab.strategies.state_bytes import state_bytes

# Called on each micro batch's loss: returns (the loss to report, the tensor to backpropagate),
# after dividing by the accumulation steps, injecting test faults and scaling for fp16.
LossHook = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class Strategy:
    wrapper_casts = False  # the wrapper applies mixed precision itself (no autocast on top)
    sharded_grads = False  # gradients are shards: fp16 loss scaling needs ShardedGradScaler
    no_sync_is_local = False  # no_sync() skips every collective (a compute-only step is measurable)
    contiguous_params = False  # the wrapper takes parameters in the default layout only

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.precision = cfg.train.precision
        self.dp_mesh: Any = None  # a DeviceMesh's "dp" dimension, for strategies on a 2-D mesh

    # --- which data this rank trains on -----------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: ranks of one replica see the same samples."""
        return self.ctx.rank if self.dp_mesh is None else self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (the global batch is split over these)."""
        return self.ctx.world_size if self.dp_mesh is None else self.dp_mesh.size()

    # --- model and optimizer -------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """Steps common to all strategies: SyncBatchNorm if asked, move to the device."""
        if self.cfg.strategy.sync_batchnorm:
            from dtlab.strategies.syncbn import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.ctx.device)
        return model.to(self.ctx.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must wrap the model")

    def setup(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = self.wrap(model)
        return model, build_optimizer(model.parameters(), self.cfg.train)

    def step_engine(self, model: nn.Module, forward: nn.Module,
                    optimizer: torch.optim.Optimizer) -> StepEngine:
        return StepEngine(self, model, forward, optimizer)

    # --- one micro batch ------------------------------------------------------------------
    def forward_backward(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         loss_hook: LossHook) -> torch.Tensor:
        """One micro batch: forward, loss, backward. Returns this rank's loss (detached)."""
        with self.autocast():
            report, root = loss_hook(loss_fn(forward(x), y))
        root.backward()
        return report.detach()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for accumulation micro steps whose gradients must not be synchronised yet
        (one process: there is nothing to synchronise)."""
        return nullcontext()

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.wrapper_casts else autocast(self.precision, self.ctx.device)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        if self.precision != "fp16":
            return None
        if self.sharded_grads:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.ctx.device.type)
        return torch.amp.GradScaler(self.ctx.device.type)

    def grad_norm(self, model: nn.Module, clip: float = 0.0) -> torch.Tensor:
        """The global gradient norm, the same on every rank, clipping the gradients to `clip`
        when it is > 0. Replicated gradients: a local computation; DTensor gradients (FSDP2,
        HSDP, TP): summed from the local shards (strategies/grad_norm.py), or as DTensors when
        a layout mixes in Partial placements or plain tensors."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        grads = [p.grad for p in params]
        if grad_norm.local_layout(grads):  # the same number without DTensor's dispatch
            norm = grad_norm.total_norm(grads)
            if clip:
                grad_norm.clip_(grads, clip, norm)
            return norm
        norm = torch.nn.utils.get_total_norm(grads)
        if clip:  # with the norm as computed: a DTensor scales DTensor gradients
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return full_value(norm)

    # --- metrics and evaluation ------------------------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel replicas, in place (one copy of each replica's value)."""
        return self.ctx.all_reduce_sum(tensor)

    def mean_loss(self, step_loss: torch.Tensor) -> float:
        """The step's loss over the global batch, from each replica's mean (for logging)."""
        return self.reduce_sum(step_loss.clone()).item() / self.dp_size

    @torch.no_grad()
    def evaluate(self, forward: nn.Module, loader: EvalLoader) -> dict[str, Any]:
        """Validation loss and accuracy over every sample once, reduced across replicas as sums."""
        forward.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss, correct, count
        for x, y, mask in loader:
            with self.autocast():
                logits = full_value(forward(x))  # TP: vocabulary-sharded logits, gathered
            totals += eval_totals(logits, y, mask)
        # What each rank would report without the reduction: its own share of the samples.
        own = self.ctx.gather_floats([totals[1].item() / max(totals[2].item(), 1), totals[2].item()])
        self.reduce_sum(totals)
        forward.train()
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count),
                "val_acc_own_samples_per_rank": [r[0] for r in own],
                "val_count_own_samples_per_rank": [int(r[1]) for r in own]}

    # --- state ---------------------------------------------------------------------------
    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, full: bool = True
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state with the wrapper's prefixes removed.

        full=True gathers unsharded tensors (every rank takes part; on CPU nothing is offloaded
        because FSDP1's offload path pins memory); full=False returns the local shards.
        """
        from torch.distributed.checkpoint.state_dict import (  # DCP and DTensor: imported when used
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(full_state_dict=full, cpu_offload=False)
        if optimizer is None:
            return get_model_state_dict(model, options=options), {}
        return get_state_dict(model, optimizer, options=options)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        """Put back what `state_dict(full=False)` returned (filled from a checkpoint)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=False))

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Exact bytes of the parameters, gradients and optimizer state this rank holds."""
        return state_bytes(model, optimizer)

    def in_one_process(self) -> AbstractContextManager[Any]:
        """What this strategy's library needs to run as one rank of a world that exists only in
        this process, under a fake process group (dtlab predict's trace): nothing by default."""
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        """The options that define this strategy's behaviour, for summary.json."""
        return {}

    def close(self) -> None:
        """At the end of a run, before the process group goes: release what the strategy holds
        outside this process's memory (files). Nothing by default."""


class StepEngine:
    """What one optimizer step does with a model and a torch optimizer, through the strategy's
    pieces. dtlab/run/step.py drives it: zero_grad, micro_step per micro batch, grad_norm, then step
    (or skip, for a non-finite step under nan_policy=skip)."""

    def __init__(self, strategy: Strategy, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.strategy, self.model, self.forward, self.optimizer = strategy, model, forward, optimizer
        self.scaler = strategy.grad_scaler()
        # Observers of the step, called as probe(event, step) with event "micro" (after an
        # accumulation micro step), "before_step" or "after_step"
        self.probes: list[Callable[[str, int], None]] = []

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, loss_hook: LossHook,
                   sync: bool) -> torch.Tensor:
        with nullcontext() if sync else self.strategy.no_sync(self.model):
            return self.strategy.forward_backward(self.forward, x, y, loss_hook)

    def grad_norm(self, clip: float) -> torch.Tensor | None:
        """The global norm (clipping to `clip` > 0); None under fp16 loss scaling, whose scaler
        finds non-finite gradients and skips those steps itself."""
        if self.scaler is None:
            return self.strategy.grad_norm(self.model, clip)
        if clip:
            self.scaler.unscale_(self.optimizer)
            self.strategy.grad_norm(self.model, clip)
        return None

    def step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def skip(self) -> None:
        """Drop this step's gradients without applying them."""
        self.optimizer.zero_grad(set_to_none=True)

    def measurements(self) -> dict[str, Any]:
        """What the engine measured about its steps, for summary.json (every rank calls it)."""
        return {}


def full_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def eval_totals(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(loss sum, correct, count) of one evaluation batch; padding samples (mask 0) count nothing."""
    weight = mask.view(-1, *[1] * (y.dim() - 1)).expand_as(y).double()
    per_item = loss_fn(logits, y, reduction="none").view(y.shape)
    return torch.stack([
        (per_item.double() * weight).sum(),
        ((logits.argmax(-1) == y).double() * weight).sum(),
        weight.sum(),
    ])
