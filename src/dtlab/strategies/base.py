"""The strategy interface: everything the training loop needs to know about a parallelism.

A strategy wraps the model, builds the optimizer over what the wrapped model holds (its shards),
says which data-parallel replica this rank belongs to (the data loaders deal batches by it), runs
one micro batch's forward and backward, controls gradient synchronisation for accumulation micro
steps, clips gradients correctly for its layout, picks the autocast/grad-scaler pair for the
precision, reduces metrics over the replicas, evaluates, and produces state dicts.

The defaults below serve the data-parallel strategies (every rank is its own replica); tensor and
pipeline parallelism, and engines with their own backward (DeepSpeed), override what differs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from dtlab.config import Config
from dtlab.data import EvalLoader
from dtlab.distributed import DistContext
from dtlab.metrics import state_bytes
from dtlab.models import loss_fn
from dtlab.optim import build_optimizer

# Called on each micro batch's loss: returns (the loss to report, the tensor to backpropagate),
# after dividing by the accumulation steps, injecting test faults and scaling for fp16.
LossHook = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """bf16/fp16 autocast on the device, nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class Strategy:
    name = "base"
    wrapper_casts = False  # the wrapper applies mixed precision itself (no autocast on top)
    sharded_grads = False  # gradients are shards: fp16 loss scaling needs ShardedGradScaler

    def __init__(self, cfg: Config, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.precision = cfg.train.precision

    # --- which data this rank trains on -----------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: ranks of one replica see the same samples."""
        return self.ctx.rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (the global batch is split over these)."""
        return self.ctx.world_size

    # --- model and optimizer -------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """Steps common to all strategies: SyncBatchNorm if asked, move to the device."""
        if self.cfg.strategy.sync_batchnorm:
            from dtlab.strategies.syncbn import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.ctx.device)
        return model.to(self.ctx.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # Built after wrapping, over the wrapped model's (possibly sharded) parameters.
        return build_optimizer(model.parameters(), self.cfg.train)

    # --- the step ------------------------------------------------------------------------
    def forward_backward(self, forward: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         loss_hook: LossHook) -> torch.Tensor:
        """One micro batch: forward, loss, backward. Returns this rank's loss (detached)."""
        with self.autocast():
            report, root = loss_hook(loss_fn(forward(x), y))
        root.backward()
        return report.detach()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients before a step's first micro batch."""
        optimizer.zero_grad(set_to_none=True)

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Discard this step's gradients without applying them (a non-finite step, nan_policy=skip)."""
        optimizer.zero_grad(set_to_none=True)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context for accumulation micro steps whose gradients must not be synchronised yet."""
        return nullcontext()

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.wrapper_casts else autocast(self.precision, self.ctx.device)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 needs loss scaling; bf16 and fp32 do not."""
        if self.precision != "fp16":
            return None
        if self.sharded_grads:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.ctx.device.type)
        return torch.amp.GradScaler(self.ctx.device.type)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # DTensor gradients (FSDP2, TP): the norm is computed over all shards (a DTensor result).
        return full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm, without clipping. Replicated gradients: a local computation;
        DTensor gradients: the DTensor's full value reduces over the shards."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return full_value(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros(())

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

    def describe(self) -> dict[str, Any]:
        """The options that define this strategy's behaviour, for summary.json."""
        return {}

    def measurements(self) -> dict[str, Any]:
        """What this strategy measured itself, for summary.json (every rank calls it)."""
        return {}


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full (unsharded, reduced) value; a plain tensor as it is."""
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


class MeshDataParallel:
    """For strategies on a 2-D ("dp", other) device mesh (tp, fsdp_tp, pp): the data-parallel
    replica is the rank's coordinate on the "dp" dimension. List it before Strategy."""

    mesh: Any  # a DeviceMesh with a "dp" dimension (DTensor is imported only by these strategies)

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()
