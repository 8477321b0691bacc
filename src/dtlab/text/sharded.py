"""A language model split over the ranks for `dtlab sample --nproc-per-node N --inference S`.

- `tp`: torch's own tensor parallelism (DTensor, `parallelize_module`) with the plans training
  uses (strategies/tp_plans.py: dtlab's GPT and Hugging Face Llama-family decoders): q/k/v and
  the MLP's first projections column-parallel, the output projections row-parallel, the
  embedding and head split over the vocabulary, norms sequence-parallel.
- `deepspeed`: DeepSpeed inference with AutoTP (`deepspeed.init_inference(tensor_parallel=...)`,
  no kernel injection): it splits the Llama family's linear layers by their names. It refuses
  GPT-2-style models ("use kernel injection"). With `kernel_inject` (CUDA only: DeepSpeed's
  fused kernels have no CPU implementation) it replaces the Hugging Face blocks it has kernels
  for by its own, in fp16, GPT-2-style ones too. dtlab's GPT has neither; every refusal comes
  before any rank starts (`check`). The kernel path has not run yet (it
  needs a GPU).

Each returns a forward of the same contract as the unsharded model: token ids (1, T) on the CPU
in, the full logits (1, T, vocabulary) on the CPU out, on every rank.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtlab.errors import DtlabError

STRATEGIES = ("tp", "deepspeed")
Forward = Callable[[torch.Tensor], torch.Tensor]


def _hf_llama_problem(cfg: Any) -> str | None:
    """Why the Llama plan (and AutoTP's) cannot split this model.name=hf model, or None."""
    from dtlab.config.strategies.tp_spec import _hf_parameter_names, hf_unknown_parameters
    from dtlab.config.transformers_config import hf_config

    config = hf_config(cfg.model)
    arch = type(config).__name__.removesuffix("Config")
    unknown = hf_unknown_parameters(_hf_parameter_names(cfg.model, config))
    if unknown:
        return f"{arch} (its {unknown} is not a Llama-style projection or norm)"
    if getattr(config, "tie_word_embeddings", False):
        return f"{arch} with tie_word_embeddings (the embedding and the head split differently)"
    return None


def _split_sizes(cfg: Any) -> list[tuple[str, int]]:
    """The sizes split over the ranks (heads, key/value heads, MLP width, vocabulary), and the
    context, which sequence parallelism splits (a shorter one is padded up to a multiple)."""
    m = cfg.model
    if m.name == "gpt":
        sizes = [("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size)]
    else:
        from dtlab.config.transformers_config import hf_config

        config = hf_config(m)
        sizes = [(f"model.hf.config.{f}", getattr(config, f)) for f in (
            "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
            if isinstance(getattr(config, f, None), int)]
    return [*sizes, ("model.block_size", m.block_size)]


def check(cfg: Any, inference: str, nproc: int, device: str = "auto",
          kernel_inject: bool = False) -> None:
    """Before any rank starts: the model/strategy pair, and whether N ranks can split it and fit
    this machine (`device`: auto, cpu or cuda, as the ranks will pick it); each problem is one
    line naming the fix."""
    if nproc < 2:
        raise DtlabError(f"--inference {inference} splits the model over ranks, and "
                         "--nproc-per-node is 1; fix: --nproc-per-node 2 (or more), or drop "
                         "--inference to sample in one process")
    if device == "cuda" and not torch.cuda.is_available():
        raise DtlabError("--device cuda, but no CUDA device is visible; fix: --device cpu")
    if device != "cpu" and torch.cuda.is_available():
        if nproc > (gpus := torch.cuda.device_count()):
            raise DtlabError(f"--nproc-per-node {nproc} is more than the {gpus} visible GPU(s) "
                             "(one rank per GPU); fix: --nproc-per-node "
                             f"{gpus}{' or fewer' if gpus > 1 else ''}, or --device cpu to "
                             "split it over CPU cores")
    elif nproc > (cores := os.cpu_count() or 1):  # more ranks than cores only take turns
        raise DtlabError(f"--nproc-per-node {nproc} is more than this machine's {cores} CPU "
                         f"core(s) (each rank computes on its own); fix: --nproc-per-node "
                         f"{cores} or fewer")
    name = cfg.model.name
    on_cuda = device != "cpu" and torch.cuda.is_available()
    if kernel_inject and not on_cuda:
        why = "--device cpu" if device == "cpu" else "no CUDA device is visible"
        raise DtlabError("--kernel-inject runs DeepSpeed's fused CUDA kernels, and the ranks "
                         f"would compute on the CPU ({why}); fix: drop --kernel-inject (AutoTP "
                         "splits Llama-family models on the CPU)")
    if kernel_inject and name == "gpt":
        raise DtlabError("--kernel-inject has no kernels for dtlab's GPT (DeepSpeed's are for "
                         "Hugging Face models); fix: --inference tp")
    if kernel_inject:
        return  # DeepSpeed splits what it injects; a model it has no kernels for fails there
    if inference == "deepspeed" and name == "gpt":
        raise DtlabError("--inference deepspeed cannot split dtlab's GPT (DeepSpeed's AutoTP "
                         "refuses GPT-2-style blocks and its kernel injection has no CPU "
                         "implementation); fix: --inference tp")
    if name == "hf" and (problem := _hf_llama_problem(cfg)):
        raise DtlabError(f"--inference {inference} has no tensor-parallel split for {problem}; "
                         "fix: sample in one process (drop --nproc-per-node), or use a "
                         "Llama-family model (Llama, Mistral, Qwen2) or dtlab's GPT with "
                         "--inference tp")
    sizes = _split_sizes(cfg)
    for what, value in sizes:
        if value % nproc:
            fits = [d for d in range(2, nproc) if all(v % d == 0 for _, v in sizes)]
            fix = f"--nproc-per-node {fits[-1]}" if fits else "sample in one process (drop " \
                "--nproc-per-node)"
            raise DtlabError(f"{what}={value} is not divisible by --nproc-per-node {nproc} "
                             f"(heads, MLP width, vocabulary and context are split over the "
                             f"ranks); fix: {fix}")


def shard(model: nn.Module, inference: str, ctx: Any,
          kernel_inject: bool = False) -> tuple[Forward, nn.Module]:
    """`model` (full, on the CPU) split over ctx's ranks: its forward (see the module's doc), and
    the module holding this rank's weights."""
    # Split on the CPU: each moves a tensor to the device as it splits it (DTensor per tensor,
    # DeepSpeed after AutoTP), so the device never holds the whole model.
    if inference == "tp":
        return _tensor_parallel(model, ctx)
    return _deepspeed(model, ctx, kernel_inject)


def _tensor_parallel(model: nn.Module, ctx: Any) -> tuple[Forward, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from dtlab.strategies.tp_plans import plan_for

    n = ctx.world_size
    plan = plan_for(model)
    if plan.prepare is not None:
        plan.prepare(model)
    mesh = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",))
    model = parallelize_module(model, mesh, plan.styles).to(ctx.device)  # and what it left

    def forward(idx: torch.Tensor) -> torch.Tensor:
        # Sequence parallelism gives each rank 1/n of the positions: pad the context on the
        # right to a multiple of n. A causal model's positions never see later ones, so the
        # logits of the real positions are unchanged (check() made block_size a multiple of n).
        t = idx.shape[1]
        padded = torch.nn.functional.pad(idx, (0, -t % n)).to(ctx.device)
        logits = model(padded)
        if isinstance(logits, DTensor):  # the head's vocabulary shards: gather them
            logits = logits.full_tensor()
        return logits[:, :t].cpu()

    return forward, model


def _deepspeed(model: nn.Module, ctx: Any, kernel_inject: bool) -> tuple[Forward, nn.Module]:
    from dtlab.strategies.deepspeed import import_deepspeed

    # DeepSpeed's CPU accelerator counts its devices by LOCAL_SIZE (the deepspeed launcher sets
    # it; without it, its shared-memory all-reduce crashes with SIGSEGV under other launchers).
    os.environ["LOCAL_SIZE"] = str(ctx.env.local_world_size)
    os.environ["LOCAL_RANK"] = str(ctx.env.local_rank)
    # No JIT build of DeepSpeed's shared-memory collectives (2 min on first use): torch's own.
    deepspeed = import_deepspeed(ctx.device, shm_comm=False)
    # (it prints the layers it splits to stdout, on every rank: not into the text)
    with contextlib.redirect_stdout(io.StringIO()):
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": ctx.world_size},
            dtype=torch.float16 if kernel_inject else torch.float32,
            replace_with_kernel_inject=kernel_inject)

    def forward(idx: torch.Tensor) -> torch.Tensor:
        return engine(idx.to(ctx.device)).float().cpu()

    return forward, engine.module
