"""A small GPT (decoder-only transformer, pre-norm). Each `Block` is the sharding unit.

Blocks live in a ModuleDict keyed "0", "1", ... so that a pipeline stage that keeps only some of
them (`GPT.part`) still names their parameters as the whole model does (`h.2.attn.q_proj.weight`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        # No key bias: it adds the same amount to all scores of a query, which softmax ignores, so
        # its gradient is exactly zero and AdamW would only random-walk it on rounding noise.
        self.k_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 for the width: under tensor parallelism a rank holds n_head / tp heads.
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def head_dim(self) -> int:
        return self.q_proj.in_features // self.n_head


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 64,
        vocab_size: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleDict({str(i): Block(n_embd, n_head, dropout, bias) for i in range(n_layer)})
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def blocks(self) -> list[nn.Module]:
        return list(self.h.values())

    def block_names(self) -> list[str]:
        return list(self.h.keys())

    def part(self, blocks: list[str], first: bool, last: bool) -> GPT:
        """A GPT made of this one's modules (the same parameters, the same names): the named
        blocks, plus the embeddings if `first` and the final norm and head if `last`. A pipeline
        stage is such a part; a part without embeddings takes hidden states, one without the head
        returns them."""
        part = GPT.__new__(GPT)
        nn.Module.__init__(part)
        part.block_size = self.block_size
        part.wte, part.wpe, part.drop = (self.wte, self.wpe, self.drop) if first else (None,) * 3
        part.h = nn.ModuleDict({k: self.h[k] for k in blocks})
        part.ln_f, part.lm_head = (self.ln_f, self.lm_head) if last else (None, None)
        return part

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.wte is None:  # a pipeline stage after the first: `idx` holds hidden states
            x = idx
        else:
            if idx.dim() != 2 or idx.dtype != torch.long or idx.shape[1] > self.block_size:
                raise ValueError(
                    f"GPT expects a (batch, seq<={self.block_size}) tensor of token ids (int64), "
                    f"got {tuple(idx.shape)} {idx.dtype}"
                )
            # a context-parallel rank holds the tokens from position_offset on (strategies/cp.py)
            start = getattr(self, "position_offset", 0)
            pos = torch.arange(start, start + idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h.values():
            x = block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))
