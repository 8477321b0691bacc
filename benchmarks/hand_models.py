"""The hand-written models of benchmarks/gpu_baseline.py and resnet_memory.py: a nanoGPT-style GPT
(one fused qkv projection, scaled_dot_product_attention, GELU MLPs) and a CIFAR ResNet-18, each
with exactly dtlab's parameters and function (tests/test_gpu_baseline.py), written the way a
careful user writes them, not through dtlab's model code."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        # dtlab's attention has no key bias (it cannot change the softmax): fused, the qkv bias is
        # q's and v's around a constant zero, so that the parameters are exactly dtlab's.
        self.q_bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.v_bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.register_buffer("k_bias", torch.zeros(d), persistent=False)
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in F.linear(x, self.qkv.weight, bias).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=bias), nn.LayerNorm(d, bias=bias)
        self.attn = Attention(d, n_head, bias)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class HandGPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int,
                 bias: bool = True, tie_weights: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's init, residual projections scaled
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def conv_bn(c_in: int, c_out: int, k: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, stride, k // 2, bias=False), nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*conv_bn(c_in, c_out, 3, stride), nn.ReLU(inplace=True),
                                  *conv_bn(c_out, c_out, 3, 1))
        down = stride != 1 or c_in != c_out
        self.short = nn.Sequential(*conv_bn(c_in, c_out, 1, stride)) if down else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


def hand_resnet(depth: int, width: float, in_channels: int, num_classes: int) -> nn.Module:
    """CIFAR ResNet: 3x3 stem without max-pool, four stages of basic blocks, global pool, fc."""
    w = [max(1, round(c * width)) for c in (64, 128, 256, 512)]
    layers: list[nn.Module] = [*conv_bn(in_channels, w[0], 3, 1), nn.ReLU(inplace=True)]
    for i, n in enumerate({18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}[depth]):
        layers += [BasicBlock(w[max(0, i - 1)], w[i], 1 if i == 0 else 2)]
        layers += [BasicBlock(w[i], w[i], 1) for _ in range(n - 1)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w[-1], num_classes)]
    return nn.Sequential(*layers, *head)


def hand_model(cfg: Any) -> nn.Module:
    m = cfg.model
    if m.name == "gpt":
        return HandGPT(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size, m.bias,
                       m.tie_weights)
    s = cfg.data.synthetic
    return hand_resnet(m.depth, m.width, s.in_channels, s.num_classes)
