"""Batch statistics over the global batch instead of each rank's local batch.

On CUDA this is `torch.nn.SyncBatchNorm`. PyTorch's SyncBatchNorm refuses CPU tensors, so on CPU
`GlobalBatchNorm2d` does the same with two differentiable all-reduces (sum, then the centred sum of
squares): the forward and backward equal BatchNorm over the concatenated global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class AllReduceSum(torch.autograd.Function):
    """Differentiable sum over ranks: the gradient of a sum over ranks is the sum of the gradients.

    (torch.distributed.nn.functional.all_reduce does this but is deprecated in torch 2.13, and its
    replacement in _functional_collectives gained autograd only in recent releases.)
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    backward = forward  # the incoming gradient, summed over ranks the same way


class GlobalBatchNorm2d(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        dims = (0, 2, 3)
        local_count = torch.tensor([x.numel() / x.shape[1]], device=x.device, dtype=x.dtype)
        count = AllReduceSum.apply(local_count)
        mean = AllReduceSum.apply(x.sum(dims)) / count
        centred = x - mean.view(1, -1, 1, 1)
        var = AllReduceSum.apply((centred * centred).sum(dims)) / count
        if self.track_running_stats:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 0.1
                unbiased = var * count / (count - 1)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
                self.num_batches_tracked.add_(1)
        y = centred * torch.rsqrt(var + self.eps).view(1, -1, 1, 1)
        if self.affine:
            y = y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        return y


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d) and not isinstance(child, GlobalBatchNorm2d):
            new = GlobalBatchNorm2d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            convert_sync_batchnorm(child, device)
    return model
