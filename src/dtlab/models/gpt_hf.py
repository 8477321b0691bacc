"""dtlab's GPT <-> Hugging Face GPT-2 (`GPT2LMHeadModel`): the config and the weights, both ways.

The two compute the same function in eval mode: pre-norm blocks, exact GELU ("gelu"), LayerNorm
eps 1e-5, attention scaled by 1/sqrt(head_dim). The layouts differ:
- GPT-2's Conv1D stores a weight as [in, out] (x @ W + b); nn.Linear as [out, in].
- GPT-2 fuses q, k, v into one c_attn; dtlab keeps three projections.
- GPT-2 always has biases. dtlab's k_proj has none (a key bias adds the same amount to every score
  of a query, which softmax ignores, so dropping one loses nothing), and `bias: false` models have
  none at all: zeros go where GPT-2 expects one.
- A tied head is not stored: GPT-2 ties lm_head to wte when tie_word_embeddings is true.

Torch only: transformers is not needed to write or read these. Tensors are produced one at a time
in model order, so a caller that reads its input block by block holds about one block at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

Tensor = torch.Tensor
Named = Iterator[tuple[str, Tensor]]
EPS = 1e-5  # nn.LayerNorm's default, which dtlab's GPT uses
# GPT2Config fields the conversion depends on, with the values dtlab's GPT implies.
_FIXED = {"activation_function": "gelu", "layer_norm_epsilon": EPS, "scale_attn_weights": True,
          "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


def to_gpt2(cfg: Any, named: Mapping[str, Tensor]) -> tuple[dict[str, Any], Named]:
    """(config.json as a dict, (GPT-2 name, tensor) in model order) of a GPT with config `cfg`
    (a GPTConfig) and tensors `named` under dtlab's names (a state dict, or a mapping that reads
    them on demand). Biases absent from `named` are written as zeros."""
    dtype = named["wte.weight"].dtype
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None, **_FIXED,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_weights, "use_cache": True,
        # GPT-2's defaults name its tokenizer's 50256; dtlab's vocabularies have no such token.
        "bos_token_id": None, "eos_token_id": None, "dtype": str(dtype).removeprefix("torch."),
        # What GPT-2's layout cannot say (bias: false is written as zeros), for from_gpt2.
        "dtlab": {"bias": cfg.bias},
    }
    return config, _gpt2_tensors(cfg, named)


def _gpt2_tensors(cfg: Any, named: Mapping[str, Tensor]) -> Named:
    def bias(name: str, width: int, like: Tensor) -> Tensor:
        b = named.get(name)
        return b if b is not None else torch.zeros(width, dtype=like.dtype)

    def linear(src: str, dst: str) -> Iterator[tuple[str, Tensor]]:
        w = named[f"{src}.weight"]
        yield f"{dst}.weight", w.t().contiguous()
        yield f"{dst}.bias", bias(f"{src}.bias", w.shape[0], w)

    def norm(src: str, dst: str) -> Iterator[tuple[str, Tensor]]:
        w = named[f"{src}.weight"]
        yield f"{dst}.weight", w
        yield f"{dst}.bias", bias(f"{src}.bias", w.shape[0], w)

    yield "transformer.wte.weight", named["wte.weight"]
    yield "transformer.wpe.weight", named["wpe.weight"]
    for i in range(cfg.n_layer):
        src, dst = f"h.{i}", f"transformer.h.{i}"
        yield from norm(f"{src}.ln_1", f"{dst}.ln_1")
        qkv = [f"{src}.attn.{p}_proj" for p in "qkv"]
        weights = [named[f"{p}.weight"] for p in qkv]
        yield f"{dst}.attn.c_attn.weight", torch.cat(weights).t().contiguous()
        yield f"{dst}.attn.c_attn.bias", torch.cat(
            [bias(f"{p}.bias", w.shape[0], w) for p, w in zip(qkv, weights, strict=True)])
        yield from linear(f"{src}.attn.out_proj", f"{dst}.attn.c_proj")
        yield from norm(f"{src}.ln_2", f"{dst}.ln_2")
        yield from linear(f"{src}.mlp.fc", f"{dst}.mlp.c_fc")
        yield from linear(f"{src}.mlp.proj", f"{dst}.mlp.c_proj")
    yield from norm("ln_f", "transformer.ln_f")
    if not cfg.tie_weights:
        yield "lm_head.weight", named["lm_head.weight"]


def from_gpt2(config: Mapping[str, Any],
              named: Mapping[str, Tensor]) -> tuple[dict[str, Any], Named]:
    """The inverse of to_gpt2: (dtlab model config as a dict, (dtlab name, tensor) in model
    order, as GPT.state_dict() names them). Also reads a GPT-2 written elsewhere when it computes
    what dtlab's GPT does (exact "gelu", no cross-attention; names with or without
    "transformer."); its key bias is dropped, which changes no output. ValueError otherwise."""
    for key, value in _FIXED.items():
        if config.get(key, value) != value:
            raise ValueError(f"GPT-2 config {key}={config[key]!r}: dtlab's GPT has {value!r}")
    n_embd = config["n_embd"]
    if config.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"GPT-2 config n_inner={config['n_inner']}: dtlab's GPT has 4 * n_embd")
    saved = config.get("dtlab") or {}
    tie = config.get("tie_word_embeddings", True)
    model = {"name": "gpt", "n_layer": config["n_layer"], "n_head": config["n_head"],
             "n_embd": n_embd, "block_size": config["n_positions"],
             "vocab_size": config["vocab_size"], "dropout": config.get("resid_pdrop", 0.0),
             "bias": saved.get("bias", True), "tie_weights": tie}
    return model, _dtlab_tensors(model, named)


def _dtlab_tensors(model: dict[str, Any], named: Mapping[str, Tensor]) -> Named:
    def get(name: str) -> Tensor:
        return named[f"transformer.{name}"] if f"transformer.{name}" in named else named[name]

    def linear(src: str, dst: str) -> Iterator[tuple[str, Tensor]]:
        yield f"{dst}.weight", get(f"{src}.weight").t().contiguous()
        if model["bias"]:
            yield f"{dst}.bias", get(f"{src}.bias")

    def norm(src: str, dst: str) -> Iterator[tuple[str, Tensor]]:
        yield f"{dst}.weight", get(f"{src}.weight")
        if model["bias"]:
            yield f"{dst}.bias", get(f"{src}.bias")

    wte = get("wte.weight")
    yield "wte.weight", wte
    yield "wpe.weight", get("wpe.weight")
    for i in range(model["n_layer"]):
        p = f"h.{i}"
        yield from norm(f"{p}.ln_1", f"{p}.ln_1")
        q, k, v = get(f"{p}.attn.c_attn.weight").t().chunk(3)
        bq, _, bv = get(f"{p}.attn.c_attn.bias").chunk(3)
        for name, w, b in (("q_proj", q, bq), ("k_proj", k, None), ("v_proj", v, bv)):
            yield f"{p}.attn.{name}.weight", w.contiguous()
            if model["bias"] and b is not None:
                yield f"{p}.attn.{name}.bias", b.clone()  # not a view of c_attn's bias
        yield from linear(f"{p}.attn.c_proj", f"{p}.attn.out_proj")
        yield from norm(f"{p}.ln_2", f"{p}.ln_2")
        yield from linear(f"{p}.mlp.c_fc", f"{p}.mlp.fc")
        yield from linear(f"{p}.mlp.c_proj", f"{p}.mlp.proj")
    yield from norm("ln_f", "ln_f")
    yield "lm_head.weight", wte if model["tie_weights"] else named["lm_head.weight"]
