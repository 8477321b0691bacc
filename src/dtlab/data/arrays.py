"""Datasets held as tensors (on the training device where they fit): a batch is one index_select."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


class ArrayDataset:
    """`inputs[i], targets[i]` pairs; `transform` runs on each whole batch, on the device."""

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs, self.targets, self.transform = inputs, targets, transform

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, idx: torch.Tensor) -> Batch:
        idx = idx.to(self.inputs.device)
        x, y = self.inputs[idx], self.targets[idx]
        return (self.transform(x) if self.transform else x), y


def normalizer(
    mean: Sequence[float], std: Sequence[float], device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 images -> float, scaled to [0, 1] and standardised per channel."""
    m = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=device).view(1, -1, 1, 1)

    def transform(x: torch.Tensor) -> torch.Tensor:
        return (x.float().div_(255.0) - m) / s

    return transform


def translate(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, pad: int) -> torch.Tensor:
    """Shift image i by (dy[i], dx[i]) pixels, |shift| <= pad, filling with zeros."""
    n, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (pad - dy)[:, None] + torch.arange(h, device=dev)  # (n, h)
    cols = (pad - dx)[:, None] + torch.arange(w, device=dev)  # (n, w)
    return padded[
        torch.arange(n, device=dev)[:, None, None, None],
        torch.arange(c, device=dev)[None, :, None, None],
        rows.view(n, 1, h, 1),
        cols.view(n, 1, 1, w),
    ]


def augmenter(
    base: Callable[[torch.Tensor], torch.Tensor] | None, generator: torch.Generator, pad: int = 4
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Random crop (zero padding `pad`) and horizontal flip, drawn from a per-rank generator."""

    def transform(x: torch.Tensor) -> torch.Tensor:
        x = base(x) if base else x
        n, dev = len(x), generator.device
        dy, dx = torch.randint(-pad, pad + 1, (2, n), generator=generator, device=dev).to(x.device)
        x = translate(x, dy, dx, pad)
        flip = torch.rand(n, generator=generator, device=dev).to(x.device) < 0.5
        return torch.where(flip[:, None, None, None], x.flip(-1), x)

    return transform


class TokenWindows:
    """Sample i = tokens[i*T : i*T + T + 1] of a 1-D token file (memory-mapped, read per batch)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, device: torch.device) -> None:
        self.tokens, self.seq_len, self.device = tokens, seq_len, device
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: torch.Tensor) -> Batch:
        starts = idx.cpu().numpy()[:, None] * self.seq_len
        window = self.tokens[starts + np.arange(self.seq_len + 1)].astype(np.int64)
        seq = torch.from_numpy(window).to(self.device)
        return seq[:, :-1], seq[:, 1:]
