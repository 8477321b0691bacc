"""Tensor-parallel plans: the DTensor parallel style of each module, chosen from the model's
parameter names (dtlab's GPT; Hugging Face Llama-family decoders), with what each needs beyond
`parallelize_module` (strategies/tp.py applies them).

Both plans make the same choices (Megatron-style with sequence parallelism, as torchtitan's
Llama plan): per block, norms SequenceParallel (replicated weights, each rank normalises its 1/tp
of the sequence); the attention's and the MLP's input all-gathered along the sequence; q, k, v
(and the MLP's first projections: GPT's fc, Llama's gate and up) column-parallel, so each rank
computes heads/tp heads and KV heads/tp key/value heads; the output projections (out_proj or
o_proj, proj or down_proj) row-parallel, their partial sums reduce-scattered into sequence shards.
The token embedding is row-parallel (1/tp of the rows per rank) and its output reduce-scattered
into sequence shards; the final norm is sequence-parallel; the head column-parallel, its
vocabulary-sharded logits kept as a DTensor for `loss_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dtlab.config.strategies.tp_spec import hf_unknown_parameters
from dtlab.errors import ConfigError


@dataclass
class TPPlan:
    styles: dict[str, Any]  # FQN pattern -> parallel style, as parallelize_module takes them
    # Row-sharded embedding tables: DTensor gives them a full-size (replicated) gradient
    tables: tuple[str, ...]
    # Run on the model before parallelize_module (hooks the plan relies on)
    prepare: Callable[[nn.Module], None] | None = field(default=None)


def _to_full_sequence() -> PrepareModuleInput:
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _head() -> ColwiseParallel:
    return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                           use_local_output=False)


def gpt_plan() -> dict[str, Any]:
    """The parallel style of each module of dtlab's GPT."""
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (T, C)
        "h.*.ln_1": SequenceParallel(),
        "h.*.attn": _to_full_sequence(),
        "h.*.attn.q_proj": ColwiseParallel(),
        "h.*.attn.k_proj": ColwiseParallel(),
        "h.*.attn.v_proj": ColwiseParallel(),
        "h.*.attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "h.*.ln_2": SequenceParallel(),
        "h.*.mlp": _to_full_sequence(),
        "h.*.mlp.fc": ColwiseParallel(),
        "h.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        "lm_head": _head(),
    }


def llama_plan(prefix: str = "lm.") -> dict[str, Any]:
    """The parallel style of each module of a transformers Llama-family causal LM (Llama,
    Mistral, Qwen2: blocks of self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj), its
    modules under `prefix` (dtlab's HFCausalLM holds the transformers model as `lm`)."""
    block = f"{prefix}model.layers.*"
    return {
        f"{prefix}model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                       output_layouts=Shard(1)),
        f"{block}.input_layernorm": SequenceParallel(),
        # the decoder layer passes the attention its input by keyword
        f"{block}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        f"{block}.self_attn.q_proj": ColwiseParallel(),
        f"{block}.self_attn.k_proj": ColwiseParallel(),
        f"{block}.self_attn.v_proj": ColwiseParallel(),
        f"{block}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{block}.post_attention_layernorm": SequenceParallel(),
        f"{block}.mlp": _to_full_sequence(),
        f"{block}.mlp.gate_proj": ColwiseParallel(),
        f"{block}.mlp.up_proj": ColwiseParallel(),
        f"{block}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}model.norm": SequenceParallel(),
        f"{prefix}lm_head": _head(),
    }


def _full_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """transformers numbers the positions from its embeddings' length, which sequence
    parallelism makes 1/tp of the sequence: number them from the (replicated) token ids, so the
    rotary embedding covers the whole sequence the attention sees after its all-gather."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if kwargs.get("position_ids") is None and ids is not None:
        kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return args, kwargs


def _prepare_llama(model: nn.Module) -> None:
    model.lm.model.register_forward_pre_hook(_full_positions, with_kwargs=True)


def plan_for(model: nn.Module) -> TPPlan:
    """The plan for `model`, known from its parameter names; an architecture whose parameters no
    plan covers (each must be split or replicated knowingly) is refused, naming it."""
    names = [n for n, _ in model.named_parameters()]
    if any(n.startswith("h.") for n in names) and "wte.weight" in names:
        return TPPlan(gpt_plan(), ("wte.weight", "wpe.weight"))
    if all(n.startswith("lm.") for n in names):
        lm = model.lm
        unknown = hf_unknown_parameters([n.removeprefix("lm.") for n in names])
        if unknown:
            raise ConfigError(
                f"tensor parallelism has no plan for {type(lm).__name__} (its {unknown} is "
                "neither a Llama-style projection nor a norm); fix: use a Llama-family model "
                "(Llama, Mistral, Qwen2), or a data-parallel strategy (fsdp, ddp)")
        return TPPlan(llama_plan(), ("lm.model.embed_tokens.weight",), _prepare_llama)
    raise ConfigError(f"tensor parallelism has no plan for {type(model).__name__}; fix: use "
                      "model.name=gpt or a Llama-family model.name=hf")

