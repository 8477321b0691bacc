"""Activation memory of dtlab's models: what autograd saves for backward, and the peak during it.

A model is a list of segments (blocks, and what comes before and after), each a list of ops in
forward order, with the bytes each saves for backward (freed after its backward), the gradients
alive during its backward, and autocast's cached 16-bit weight copies. The peak walks the ops in
reverse; checkpointing (per block, non-reentrant) keeps a block's input and recomputes the rest.
Read off autograd's saved tensors (tests/test_estimate.py compares them exactly) in fp32,
`autocast` and `half` (the model itself 16-bit). Not counted: dropout masks (dropout is 0 by
default), the batch, allocator overhead. The details: docs/memory.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dtlab.errors import DtlabError


@dataclass(frozen=True)
class Op:
    name: str
    saved: float  # bytes it keeps for backward that no earlier op keeps
    grad_out: float  # the gradient of its output, alive during its backward
    grad_in: float  # the gradient it computes for its input (0 where none is needed)
    extra: float = 0.0  # also alive then: a residual path's gradient, a weight's new gradient
    casts: float = 0.0  # the part of `saved` that is autocast's 16-bit copies of weights


@dataclass
class Segment:
    name: str
    ops: list[Op]
    input_bytes: float = 0.0  # what a checkpoint keeps of it (its input, if new memory)
    block: bool = False  # a sharding unit: checkpointed when checkpointing is on

    @property
    def saved(self) -> float:
        return sum(op.saved for op in self.ops)


@dataclass(frozen=True)
class Activations:
    saved: float  # bytes kept for backward at the end of forward
    peak: float  # the most alive at once during backward (saved + gradients in flight)


def recomputed(segments: list[Segment], checkpoint: bool | tuple[int, ...]) -> list[bool]:
    """Per segment, whether it is checkpointed: every block (True), none (False), or the blocks
    at these indices (counting blocks only: train.activation_checkpointing=selective)."""
    blocks = itertools.accumulate(s.block for s in segments)  # blocks up to and including s
    return [s.block and (checkpoint if isinstance(checkpoint, bool) else b - 1 in checkpoint)
            for s, b in zip(segments, blocks, strict=True)]


def walk(segments: list[Segment], checkpoint: bool | tuple[int, ...]) -> Activations:
    ck = recomputed(segments, checkpoint)
    kept = [s.input_bytes if c else s.saved for s, c in zip(segments, ck, strict=True)]
    live = sum(kept)
    cached = sum(op.casts for s, c in zip(segments, ck, strict=True) if c for op in s.ops)
    peak = live + cached  # the end of forward
    for seg, c in reversed(list(zip(segments, ck, strict=True))):
        if c:  # recomputing saves everything again, the input included
            live += seg.saved - seg.input_bytes
        for op in reversed(seg.ops):
            peak = max(peak, live + op.grad_out + op.grad_in + op.extra)
            live -= op.saved
    return Activations(sum(kept), peak)


def elem_sizes(mode: str) -> tuple[int, int, int]:
    """Bytes per element of a precision mode: (activations, the residual stream and layer norms,
    autocast's saved 16-bit copies of weights)."""
    if mode not in ("fp32", "autocast", "half"):
        raise DtlabError(f"activation precision '{mode}' is not fp32, autocast or half")
    return (4, 4, 0) if mode == "fp32" else (2, 4, 2) if mode == "autocast" else (2, 2, 0)


# ------------------------------------------------------------------------------------- GPT
def gpt_segments(n_layer: int, n_embd: int, n_head: int, seq: int, vocab: int, micro: int,
                 mode: str, block_size: int | None = None) -> list[Segment]:
    """dtlab's GPT (pre-norm, 4x MLP with GELU, scaled_dot_product_attention, no dropout)."""
    a, r, wc = elem_sizes(mode)
    h, tok = n_embd, micro * seq
    th = tok * h
    stats = 2 * (2 if mode == "half" else 4) * tok  # layer norm: mean and rstd per token
    lse = 4 * micro * n_head * seq  # attention's log-sum-exp, fp32
    ops = [  # every block's
        Op("ln_1", r * th + stats, r * th, r * th, r * th),
        # q, k, v projections read the same normed input: autocast casts it once per consumer
        Op("qkv", (3 if wc else 1) * a * th + wc * 3 * h * h, 3 * a * th, r * th,
           r * th + 4 * 3 * h * h, wc * 3 * h * h),
        Op("attention", 4 * a * th + lse, a * th, 3 * a * th, r * th),  # q, k, v, out
        Op("out_proj", wc * h * h, a * th, a * th, r * th + 4 * h * h, wc * h * h),
        Op("ln_2", r * th + stats, r * th, r * th, r * th),
        Op("fc", a * th + wc * 4 * h * h, 4 * a * th, r * th, r * th + 4 * 4 * h * h,
           wc * 4 * h * h),
        Op("gelu", 4 * a * th, 4 * a * th, 4 * a * th, r * th),
        Op("proj", 4 * a * th + wc * 4 * h * h, a * th, 4 * a * th, r * th + 4 * 4 * h * h,
           wc * 4 * h * h),
    ]
    blocks = [Segment(f"block{i}", ops, input_bytes=r * th, block=True) for i in range(n_layer)]
    positions = block_size or seq
    embed = Segment("embedding", [Op("embedding", 8 * seq, r * th, 0, 4 * (vocab + positions) * h)])
    head = Segment("head", [
        Op("ln_f", r * th + stats, r * th, r * th),
        Op("lm_head", a * th + wc * vocab * h, a * tok * vocab, r * th, 4 * vocab * h,
           wc * vocab * h),
        # cross-entropy in fp32: log_softmax keeps its output (and nll_loss a scalar weight)
        Op("loss", 4 * tok * vocab + 4, 4 * tok * vocab, 4 * tok * vocab),
    ])
    return [embed, *blocks, head]


# ------------------------------------------------------------------------------------- CNN
def cnn_segments(channels: list[int], hidden: int, in_channels: int, image_size: int,
                 num_classes: int, batch_norm: bool, activation: str, pool: str, micro: int,
                 mode: str) -> list[Segment]:
    """dtlab's SimpleCNN: conv stages (conv3x3, [BN], activation, pool 2) and an MLP head."""
    a, r, wc = elem_sizes(mode)
    bn = 2 * r  # batch norm's saved mean and inverse std per channel (the weights' dtype)
    b, s = micro, image_size
    segs = []
    widths = [in_channels, *channels]
    for i, (c_in, c_out) in enumerate(zip(widths, widths[1:], strict=False)):
        x_in, x_out, pooled = b * c_in * s * s, b * c_out * s * s, b * c_out * (s // 2) ** 2
        w = c_out * c_in * 9
        # conv keeps its input: the previous stage's output, or for the first the data itself
        # (only autocast's 16-bit copy of the data is new memory)
        first = i == 0
        ops = [Op("conv", (wc if first else a) * x_in + wc * w, a * x_out, 0 if first else a * x_in,
                  4 * (w + (0 if batch_norm else c_out)), wc * w)]
        if batch_norm:
            ops.append(Op("batch_norm", a * x_out + bn * c_out, a * x_out, a * x_out, 8 * c_out))
        # GELU keeps its input, ReLU its output; average pooling keeps its input (GELU's output,
        # new) and max pooling also its indices
        ops.append(Op(activation, a * x_out, a * x_out, a * x_out))
        pool_kept = (a * x_out if activation == "gelu" else 0) + (8 * pooled if pool == "max" else 0)
        ops.append(Op(f"{pool}_pool", pool_kept, a * pooled, a * x_out))
        segs.append(Segment(f"stage{i}", ops, 0 if first else a * x_in, block=True))
        s //= 2
    flat = channels[-1] * s * s
    segs.append(Segment("head", [
        Op("fc1", a * b * flat + wc * flat * hidden, a * b * hidden, a * b * flat,
           4 * (flat + 1) * hidden, wc * flat * hidden),
        Op(activation, a * b * hidden, a * b * hidden, a * b * hidden),
        Op("fc2", (a * b * hidden if activation == "gelu" else 0) + wc * hidden * num_classes,
           a * b * num_classes, a * b * hidden, 4 * (hidden + 1) * num_classes,
           wc * hidden * num_classes),
    ], a * b * flat, block=True))
    # the loss is computed outside the model: a checkpointed head does not recompute it
    segs.append(Segment("loss", [Op("loss", 4 * b * num_classes + 4, 4 * b * num_classes,
                                    4 * b * num_classes)]))
    return segs


# ---------------------------------------------------------------------------------- ResNet
def resnet_segments(widths: list[int], layout: tuple[int, ...], in_channels: int,
                    image_size: int, num_classes: int, micro: int, mode: str) -> list[Segment]:
    """dtlab's CIFAR ResNet: 3x3 stem, BasicBlocks (each block's input kept by its conv1)."""
    a, r, wc = elem_sizes(mode)
    bn = 2 * r  # batch norm's saved mean and inverse std per channel (the weights' dtype)
    b, s = micro, image_size
    c0 = widths[0]
    x = b * c0 * s * s
    stem = Segment("stem", [
        Op("conv", wc * b * in_channels * s * s + wc * c0 * in_channels * 9, a * x, 0,
           4 * c0 * in_channels * 9),
        Op("batch_norm", a * x + bn * c0, a * x, a * x, 8 * c0),
        Op("relu", 0, a * x, a * x),  # its output is the first block's input, kept there
    ])
    segs = [stem]
    c_in = c0
    for i, (c_out, n) in enumerate(zip(widths, layout, strict=True)):
        for j in range(n):
            stride = 2 if (i > 0 and j == 0) else 1
            s_out = s // stride
            x_in, y = b * c_in * s * s, b * c_out * s_out * s_out
            w1, w2 = c_out * c_in * 9, c_out * c_out * 9
            down = stride != 1 or c_in != c_out
            ops = []
            if down:  # autograd runs the shortcut's backward first: the main path's gradient waits
                ops += [Op("shortcut_conv", wc * c_out * c_in, a * y, a * x_in,
                           a * y + 4 * c_out * c_in, wc * c_out * c_in),
                        Op("shortcut_bn", a * y + bn * c_out, a * y, a * y, a * y + 8 * c_out)]
            carry = a * x_in  # the gradient reaching the input through the shortcut
            ops = [Op("conv1", a * x_in + wc * w1, a * y, a * x_in, carry + 4 * w1, wc * w1),
                   Op("bn1", a * y + bn * c_out, a * y, a * y, carry + 8 * c_out),
                   Op("relu1", a * y, a * y, a * y, carry),
                   Op("conv2", wc * w2, a * y, a * y, carry + 4 * w2, wc * w2),
                   Op("bn2", a * y + bn * c_out, a * y, a * y, carry + 8 * c_out),
                   *ops,
                   Op("relu", 0, a * y, a * y)]  # its output: the next block's input
            segs.append(Segment(f"block{len(segs) - 1}", ops, a * x_in, block=True))
            c_in, s = c_out, s_out
    segs.append(Segment("head", [
        Op("avg_pool", a * b * c_in * s * s, a * b * c_in, a * b * c_in * s * s),
        Op("fc", a * b * c_in + wc * c_in * num_classes, a * b * num_classes, a * b * c_in,
           4 * (c_in + 1) * num_classes),
        Op("loss", 4 * b * num_classes + 4, 4 * b * num_classes, 4 * b * num_classes),
    ]))
    return segs


# ------------------------------------------------------------------------------ from a config
def config_segments(cfg: object, micro: int, mode: str) -> list[Segment]:
    """Segments of a dtlab config's model (dtlab.config.Config) at `micro` samples per rank."""
    from dtlab.data import spec_for
    from dtlab.models.resnet import LAYOUTS

    m, spec = cfg.model, spec_for(cfg)  # type: ignore[attr-defined]
    if m.name == "gpt":
        return gpt_segments(m.n_layer, m.n_embd, m.n_head, m.block_size, m.vocab_size, micro, mode)
    if m.name == "cnn":
        return cnn_segments(list(m.channels), m.hidden, spec.in_channels, spec.image_size,
                            spec.num_classes, m.batch_norm, m.activation, m.pool, micro, mode)
    widths = [max(1, round(w * m.width)) for w in (64, 128, 256, 512)]
    return resnet_segments(widths, LAYOUTS[m.depth], spec.in_channels, spec.image_size,
                           spec.num_classes, micro, mode)
