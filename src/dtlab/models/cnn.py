"""SimpleCNN: a configurable stack of conv stages and an MLP head, for any batch size."""

from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}
POOLS = {"max": nn.MaxPool2d, "avg": nn.AvgPool2d}


class ConvStage(nn.Sequential):
    """conv3x3 -> [BatchNorm] -> activation -> pool 2; halves the spatial size. A sharding unit."""

    def __init__(self, c_in: int, c_out: int, batch_norm: bool, activation: str, pool: str) -> None:
        layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)]
        if batch_norm:
            layers.append(nn.BatchNorm2d(c_out))
        layers += [ACTIVATIONS[activation](), POOLS[pool](2)]
        super().__init__(*layers)


class SimpleCNN(nn.Module):
    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        channels: tuple[int, ...] | list[int] = (16, 32),
        hidden: int = 64,
        batch_norm: bool = False,
        activation: str = "gelu",
        pool: str = "avg",
    ) -> None:
        super().__init__()
        final = image_size >> len(channels)
        if final < 1:
            raise ValueError(
                f"SimpleCNN with {len(channels)} conv stages halves {image_size}px images to nothing; "
                "use fewer entries in model.channels"
            )
        self.input_shape = (in_channels, image_size, image_size)
        widths = [in_channels, *channels]
        self.stages = nn.Sequential(
            *(
                ConvStage(a, b, batch_norm, activation, pool)
                for a, b in zip(widths, widths[1:], strict=False)
            )
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels[-1] * final * final, hidden),
            ACTIVATIONS[activation](),
            nn.Linear(hidden, num_classes),
        )

    def blocks(self) -> list[nn.Module]:
        return [*self.stages, self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only the trailing dims are fixed: the batch dimension is whatever each rank receives.
        if x.dim() != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"SimpleCNN expects input of shape (batch, {', '.join(map(str, self.input_shape))}), "
                f"got {tuple(x.shape)}"
            )
        return self.head(self.stages(x))
