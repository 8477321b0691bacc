"""ResNet for 32x32 images (3x3 stem, no max-pool), depth 18 or 34, with a width multiplier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection. The sharding unit."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(
        self, depth: int = 18, width: float = 1.0, in_channels: int = 3, num_classes: int = 10
    ) -> None:
        super().__init__()
        if depth not in LAYOUTS:
            raise ValueError(f"ResNet depth must be one of {sorted(LAYOUTS)}, got {depth}")
        widths = [max(1, round(w * width)) for w in (64, 128, 256, 512)]
        self.in_channels = in_channels
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for i, (c_out, n) in enumerate(zip(widths, LAYOUTS[depth], strict=True)):
            for j in range(n):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if (i > 0 and j == 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"ResNet expects input of shape (batch, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
