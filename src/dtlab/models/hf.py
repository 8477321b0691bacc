"""Hugging Face causal language models (transformers, the `hf` extra) as dtlab models.

`model.name=hf` builds any `AutoModelForCausalLM` from a local directory (`model.hf.path`, with
its weights) or from config fields alone (`model.hf.config`, random initialisation from the seed,
as a tiny Llama in the tests). `HFCausalLM` adapts it to what the loop expects of a model: token
ids in, logits out, and `blocks()`: the decoder layers, found through the class names the model
itself declares unsplittable (`_no_split_modules`), which every strategy shards, checkpoints and
compiles one by one. Its parameters are named `lm.<the transformers name>`; export strips `lm.`.

Built under `torch.device("meta")` (FLOP counting, estimates), the model comes from its config
only: an 8B model's shapes without reading or allocating its weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtlab.config.transformers_config import (
    ATTENTION,
    LOADING,
    hf_config,
    load_hf_config,
    require_transformers,
)
from dtlab.errors import ConfigError
from dtlab.models import hf_check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def max_positions(config: Any) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check(m: Any, thorough: bool = True) -> None:
    """Before any rank starts: the config loads with sizes that fit together, the model is a
    causal LM, the sequence fits its positions, and (`thorough`) it builds on the meta device and
    model.hf.path's weights fit it (dtlab/models/hf_check.py)."""
    config = hf_config(m)
    t = require_transformers()
    if type(config) not in t.AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"model.hf: {type(config).__name__} has no causal-LM head in "
                          "transformers; fix: use a decoder-only model (Llama, GPT-2, Qwen, ...)")
    hf_check.check_causal(m, config)
    hf_check.check_sizes(m, config)
    hf_check.check_activations(m, config, t)
    hf_check.check_kinds(m, config)
    limit = max_positions(config)
    if limit is not None and m.block_size > limit:
        raise ConfigError(f"model.block_size={m.block_size} exceeds the model's {limit} "
                          f"positions; fix: set model.block_size to at most {limit}")
    if thorough:
        hf_check.check_builds(m, config, t, ATTENTION)
        if m.hf.path is not None:
            hf_check.check_weights(m, config, t, lambda fields: load_hf_config(m, fields))


class HFCausalLM(nn.Module):
    """A transformers causal LM with dtlab's model interface."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits

    def blocks(self) -> list[nn.Module]:
        names = set(getattr(self.lm, "_no_split_modules", None) or ())
        found = [m for m in self.lm.modules() if type(m).__name__ in names]
        if not found:
            raise ConfigError(f"{type(self.lm).__name__} declares no decoder-layer class "
                              "(_no_split_modules), so dtlab cannot find its blocks; fix: use a "
                              "model whose transformers class declares one (Llama, GPT-2, Qwen)")
        return found

    @property
    def config(self) -> Any:
        return self.lm.config

    def block_names(self) -> list[str]:
        """The decoder layers' indices, as pipeline stages split them (part)."""
        return [str(i) for i in range(len(self.lm.model.layers))]

    def part(self, blocks: list[str], first: bool, last: bool) -> HFStage:
        """A pipeline stage of a Llama-family model: the named decoder layers, with the token
        embedding if `first`, the final norm and head if `last`, under the whole model's names
        (`lm.model.layers.3...`), sharing this model's modules."""
        return HFStage(self, blocks, first, last)


class HFStage(HFCausalLM):
    """Token ids (first stage) or hidden states in; hidden states or logits (last) out. Each
    stage numbers the positions itself and computes the rotary table for its layers, as the
    whole model does once: the same numbers, no tensors but the hidden states cross stages."""

    def __init__(self, whole: HFCausalLM, blocks: list[str], first: bool, last: bool) -> None:
        nn.Module.__init__(self)
        src = whole.lm
        self.lm = nn.Module()
        self.lm.config = src.config
        self.lm.model = nn.Module()
        inner = self.lm.model
        inner.embed_tokens = src.model.embed_tokens if first else None
        held = src.model.layers  # the whole model's list, or an earlier part's by name
        inner.layers = nn.ModuleDict({b: held[b] if isinstance(held, nn.ModuleDict)
                                      else held[int(b)] for b in blocks})
        inner.rotary_emb = src.model.rotary_emb
        inner.norm = src.model.norm if last else None
        self.lm.lm_head = src.lm_head if last else None
        # under sequence parallelism a stage holds 1/shards of the sequence between layers
        self.sequence_shards = getattr(whole, "sequence_shards", 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.lm.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        seq = x.shape[1] if inner.embed_tokens is not None else h.shape[1] * self.sequence_shards
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        rotary = inner.rotary_emb(h, positions)
        for layer in inner.layers.values():
            out = layer(h, position_embeddings=rotary, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out
        if inner.norm is None:
            return h
        return self.lm.lm_head(inner.norm(h))

    def blocks(self) -> list[nn.Module]:
        return list(self.lm.model.layers.values())

    def block_names(self) -> list[str]:
        return list(self.lm.model.layers.keys())


def build(m: Any) -> HFCausalLM:
    """The model of an HFConfig: its weights from `path`, or initialised from the current seed;
    shapes only under torch.device("meta")."""
    t = require_transformers()
    check(m, thorough=False)  # the launcher did the rest (check_model)
    config, dtype = hf_config(m), DTYPES[m.hf.dtype]
    on_meta = torch.empty(0).device.type == "meta"
    if m.hf.path is not None and not on_meta:
        from safetensors import SafetensorError

        try:  # the files changed since the launcher checked them (check_model)
            lm = t.AutoModelForCausalLM.from_pretrained(m.hf.path, config=config, dtype=dtype,
                                                        attn_implementation=ATTENTION, **LOADING)
        except (OSError, SafetensorError, RuntimeError) as e:
            raise ConfigError(f"model.hf.path '{m.hf.path}': its weights cannot be loaded "
                              f"({str(e).splitlines()[0][:120]}); fix: point it at a complete "
                              "model directory (config.json + *.safetensors)") from None
    else:
        lm = t.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    lm.train()  # from_pretrained returns it in eval mode (dropout off)
    return HFCausalLM(lm)


def to_hf(m: Any, named: Any) -> tuple[dict[str, Any], Any]:
    """`dtlab export --format hf` of a model.name=hf checkpoint: its own config.json and its
    tensors under the transformers names (`lm.` dropped), in model order; a tied head is left to
    from_pretrained, as save_pretrained leaves it."""
    t = require_transformers("--format hf of a model.name=hf checkpoint")
    config = hf_config(m)
    cls = t.AutoModelForCausalLM._model_mapping[type(config)]
    tied = getattr(config, "tie_word_embeddings", False)
    out = {**config.to_dict(), "architectures": [cls.__name__],
           "dtype": str(named[next(iter(named))].dtype).removeprefix("torch.")}
    names = [k for k in named if not (tied and k == "lm.lm_head.weight")]
    return out, ((k.removeprefix("lm."), named[k]) for k in names)
