"""One process, no wrapper: the reference every other strategy is compared with."""

from __future__ import annotations

from torch import nn

from dtlab.strategies.base import Strategy


class Single(Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        return self.prepare(model)
