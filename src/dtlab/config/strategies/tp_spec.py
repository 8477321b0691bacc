"""`tp` (tensor parallelism over every rank) and `fsdp_tp` (FSDP2 x TP on a 2-D mesh): options and
checks (implementation: tp.py, its plans tp_plans.py). They split dtlab's GPT and Hugging Face
Llama-family decoders (model.name=hf whose parameters the Llama plan names, below)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import NonNegativeInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, check_mesh
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

KEY = "strategy.tp.degree"
# The parameters of a transformers Llama-family causal LM (Llama, Mistral, Qwen2) that the Llama
# plan (strategies/tp_plans.py) splits or replicates; anything else (Qwen3's per-head q_norm, a
# GPT-2 c_attn, experts) would be left unsplit and its gradients wrong, so it is refused.
LLAMA_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLAMA_BLOCK = {f"{p}.{w}" for p in LLAMA_PROJECTIONS for w in ("weight", "bias")} | {
    "input_layernorm.weight", "post_attention_layernorm.weight"}
LLAMA_OUTSIDE = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
_BLOCK = re.compile(r"^model\.layers\.\d+\.")
_ARCHITECTURES: dict[str, list[str]] = {}  # parameter names of a meta build, per config


class TPOptions(Section):
    degree: NonNegativeInt = 0  # ranks per tensor-parallel group; 0 = every rank


def degree(cfg: Config, world_size: int) -> int:
    return cfg.strategy.tp.degree or world_size


def hf_unknown_parameters(names: list[str]) -> str | None:
    """The first transformers parameter name (without dtlab's `lm.`) the Llama plan does not
    cover, or a projection it needs that is missing; None when the plan covers the model."""
    for name in names:
        in_block = _BLOCK.match(name) is not None
        if not (_BLOCK.sub("", name) in LLAMA_BLOCK if in_block else name in LLAMA_OUTSIDE):
            return "parameter " + name
    inside = {_BLOCK.sub("", n) for n in names if _BLOCK.match(n)}
    missing = [p for p in LLAMA_PROJECTIONS if f"{p}.weight" not in inside]
    return f"missing {missing[0]}" if missing else None


def _hf_parameter_names(m: Any, config: Any) -> list[str]:
    """The parameter names of the model, built on the meta device (~0.1 s for an 8B Llama)."""
    import json

    key = json.dumps([m.hf.path, m.hf.config], sort_keys=True, default=str)
    if key not in _ARCHITECTURES:
        import torch

        from dtlab.config.transformers_config import ATTENTION, require_transformers

        t = require_transformers()
        with torch.device("meta"):
            lm = t.AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
        _ARCHITECTURES[key] = [n for n, _ in lm.named_parameters()]
    return _ARCHITECTURES[key]


def _check_hf(cfg: Config, d: int) -> None:
    from dtlab.config.transformers_config import hf_config

    m, name = cfg.model, cfg.strategy.name
    config = hf_config(m)
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            f"tie_word_embeddings with strategy.name={name} is not supported (the embedding and "
            "the head are split differently); fix: set model.hf.config.tie_word_embeddings=false")
    unknown = hf_unknown_parameters(_hf_parameter_names(m, config))
    if unknown:
        arch = type(config).__name__.removesuffix("Config")
        raise ConfigError(
            f"strategy.name={name} has no tensor-parallel plan for {arch} (its {unknown} is not "
            "a Llama-style projection or norm); fix: use a Llama-family model (Llama, Mistral, "
            "Qwen2), or a data-parallel strategy (fsdp, ddp)")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "vocab_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % d:
            raise ConfigError(
                f"model.hf.config.{field}={value} is not divisible by the tensor-parallel degree "
                f"{d} (heads, key/value heads, MLP width and vocabulary are split over it); fix: "
                f"a smaller strategy.tp.degree that divides {value}, or another model size")


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    d = degree(cfg, world_size)
    check_mesh(cfg, world_size, d, KEY, models=("gpt", "hf"))
    if cfg.strategy.name == "tp" and d != world_size:
        raise ConfigError(
            f"strategy.name=tp puts every rank in one tensor-parallel group, but "
            f"strategy.tp.degree={d} < world_size={world_size}; fix: strategy.tp.degree=0, "
            "or strategy.name=fsdp_tp for a data-parallel dimension"
        )
    check_sizes(cfg, d, KEY)


def check_sizes(cfg: Config, d: int, key: str) -> None:
    """What a tensor-parallel degree `d` (set by `key`) splits must divide by it."""
    m = cfg.model
    if m.name == "hf":
        _check_hf(cfg, d)
        sizes = (("model.block_size", m.block_size),)
    else:
        sizes = (("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size),
                 ("model.block_size", m.block_size))
    for what, value in sizes:
        if value % d:
            raise ConfigError(
                f"{what}={value} is not divisible by the tensor-parallel degree {d} "
                f"(heads, vocabulary and sequence are split over it); fix: choose {what} as "
                f"a multiple of {d}, or a smaller {key}"
            )


SPEC = StrategySpec(
    name="tp", impl="tp:TP", about="tensor parallelism (Megatron-style, sequence parallel)",
    options=TPOptions, mesh_key=KEY, check=check, model_parallel=degree, model_dim="tp",
    flavours=("single",),
)
FSDP_TP = StrategySpec(
    name="fsdp_tp", impl="tp:FSDPTP", about="FSDP2 across tensor-parallel groups (2-D mesh)",
    mesh_key=KEY, check=check, model_parallel=degree, shards_state=True, model_dim="tp",
    flavours=("fsdp",),
)
