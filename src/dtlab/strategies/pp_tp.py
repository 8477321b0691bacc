"""Tensor parallelism inside pipeline stages (3-D: pp x dp x tp), for the GPT's stages of pp.py.

The ranks form one mesh (pp, dp, tp), tensor parallelism innermost (the ranks of one stage's
group are neighbours, on one node), the pipeline outermost, as torchtitan orders its dimensions.
Each rank applies the GPT's tensor-parallel plan (tp_plans.py: Megatron-style with sequence
parallelism) to the modules its stages hold; between stages the residual stream travels as each
tensor-parallel rank's sequence shard, (b, T/tp, C), to the same tensor-parallel rank of the next
stage. The head gives this rank's vocabulary shard of the logits as a plain tensor (a stage sends
and returns tensors); the loss takes it back as a vocabulary-sharded DTensor and computes the
cross-entropy under `loss_parallel`, so the logits are never gathered in training.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from dtlab.strategies.tp import _shard_grad_like_param
from dtlab.strategies.tp_plans import plan_for


def mesh(device_type: str, world_size: int, pp: int, tp: int) -> DeviceMesh:
    """(pp, dp, tp) for tp > 1; (dp, pp) without tensor parallelism, as pp has always built it."""
    if tp == 1:
        return init_device_mesh(device_type, (world_size // pp, pp), mesh_dim_names=("dp", "pp"))
    return init_device_mesh(device_type, (pp, world_size // (pp * tp), tp),
                            mesh_dim_names=("pp", "dp", "tp"))


def _held(model: nn.Module, pattern: str) -> bool:
    """Whether the plan entry `pattern` names modules this rank's part of the model holds (a
    stage holds some blocks, and the embedding or the head or neither)."""
    node: object = model
    for name in pattern.split("."):
        if name == "*":
            return len(node) > 0  # type: ignore[arg-type]
        node = getattr(node, name, None)
        if node is None:
            return False
    return True


def parallelize(model: nn.Module, held: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """`model`'s plan (the whole GPT's: a part's names alone do not say which model it is) on
    the modules of this rank's stages (`held`, a GPT.part of it), the head's logits returned as
    the local vocabulary shard."""
    # 2-D (dp, tp) parameters: gathering or reducing them takes one collective per dimension,
    # and DTensor warns about it on every rank for every tensor (as fsdp_tp: tp.py)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    plan = plan_for(model)
    styles = {k: v for k, v in plan.styles.items() if _held(held, k)}
    for head in [k for k in styles if k.split(".")[-1] == "lm_head"]:
        styles[head] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                       use_local_output=True)
    held.sequence_shards = tp_mesh.size()  # a stage's hidden states: 1/tp of the sequence
    parallelize_module(held, tp_mesh, styles)
    for table in plan.tables:
        if _held(held, table.rpartition(".")[0]):
            held.get_parameter(table).register_post_accumulate_grad_hook(_shard_grad_like_param)
    return held


def vocab_sharded(logits: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """This rank's (b, T, V/tp) logits as the vocabulary-sharded DTensor they are."""
    return DTensor.from_local(logits, tp_mesh, [Shard(logits.dim() - 1)], run_check=False)
