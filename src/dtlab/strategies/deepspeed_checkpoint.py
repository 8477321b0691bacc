"""DeepSpeed's training state in dtlab's DCP checkpoints (checkpoint.py and state.py do the rest:
manifest, checksums, atomic publication, keep_checkpoints, resume=auto, RNG, schedule).

What a deepspeed checkpoint holds, under the keys every strategy's state dicts fill:
- "model": the full fp32 weights (DeepSpeed's master weights, gathered) and buffers under
  `single`'s names, the entries every strategy writes: `dtlab export`, `dtlab sample` and the
  model of any strategy read them.
- "optim": `rank<r>` holds rank r's own keys: `group<i>` = its flat fp32 master partition of
  sub-group i ("fp32") and the torch optimizer's state over it (exp_avg, momentum_buffer, ...),
  the very tensors DeepSpeed steps, and `loss_scale` = its loss scaler's counters. A rank writes
  and reads its own keys only: no gather, no second copy; DCP loads them in place.
- the manifest's param_groups: the hyper-parameters, plus `deepspeed`: the layout that shaped the
  partitions (ZeRO stage, world size, sub_group_size, round_robin_gradients).

Not DeepSpeed's save_checkpoint/load_checkpoint: they torch.save and unpickle (weights_only=False).
The partitions only make sense in the layout that wrote them: `check_resume` refuses any other
with one line at set-up, before a process waits on another.
This module follows deepspeed 0.19.8's optimizer objects, as deepspeed_memory.py does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dtlab.config.strategies.spec import Config
from dtlab.errors import ConfigError
from dtlab.rundir.checkpoints import complete_checkpoints, manifest_json
from dtlab.rundir.hints import start_over

# The flat fp32 master partitions, by optimizer class: DeepSpeedZeroOptimizer (stages 1 and 2),
# BF16_Optimizer (stage 1 under bf16 without offload), DeepSpeedZeroOptimizer_Stage3.
FLATS = ("single_partition_of_fp32_groups", "fp32_groups_flat_partition",
         "fp32_partitioned_groups_flat")
SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")  # fp16's dynamic scale
LAYOUT = "deepspeed"  # the key of the layout record in each saved param group
# zero_optimization keys besides the stage that change the partitions, with DeepSpeed's defaults:
# stage 3 cuts its flat groups at sub_group_size elements; round robin reorders stages 1 and 2's.
SHAPING = {"sub_group_size": 1_000_000_000, "round_robin_gradients": False}


def flat_partitions(opt: Any) -> list[torch.Tensor]:
    for name in FLATS:
        if hasattr(opt, name):
            return list(getattr(opt, name))
    raise ConfigError(f"{type(opt).__name__}: an optimizer dtlab cannot checkpoint (not DeepSpeed "
                      "0.19's ZeRO); fix: set train.checkpoint_every=0 and resume=none")


@torch.no_grad()
def _create_state(opt: Any, flats: list[torch.Tensor]) -> None:
    """The torch optimizer's state before its first step (DCP fills tensors that exist): made by
    one step with zero gradients at lr 0, which leaves the weights as they are, then set back to
    step 0: what the optimizer itself creates at its first step (zero moments, step 0), so that a
    checkpoint taken when every step so far was skipped resumes as the run would have gone on."""
    base = opt.optimizer
    fresh = [f for f in flats if not base.state.get(f)]
    if not fresh:
        return
    grads, lrs = [f.grad for f in flats], [g["lr"] for g in base.param_groups]
    for f in flats:
        f.grad = torch.zeros_like(f)
    for g in base.param_groups:
        g["lr"] = 0.0
    stage3 = hasattr(opt, "_set_fp32_optimizer_param_groups")
    if stage3:  # ZeRO 3 hands the optimizer its partitions only while it steps
        opt._set_fp32_optimizer_param_groups()
    base.step()
    if stage3:
        opt._clear_fp32_optimizer_param_groups()
    for g, lr in zip(base.param_groups, lrs, strict=True):
        g["lr"] = lr
    for f, grad in zip(flats, grads, strict=True):
        f.grad = grad  # under offload DeepSpeed keeps a gradient buffer linked there
    for f in fresh:
        if torch.is_tensor(base.state[f].get("step")):
            base.state[f]["step"].zero_()


def full_model(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 master weights gathered into full tensors, and the buffers, with single's keys
    (every rank takes part)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    params = dict(module.named_parameters())
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if name in params:
            value = safe_get_full_fp32_param(params[name])
        out[name] = value.detach().float() if value.is_floating_point() else value.detach()
    return out


def layout(ds_config: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What decides the shape of each rank's partitions (saved with them, compared on resume)."""
    zero = ds_config["zero_optimization"]
    return {"zero_stage": zero["stage"], "world_size": world_size,
            **{k: zero.get(k, default) for k, default in SHAPING.items()}}


def optim_state(engine: Any, rank: int, saved_layout: dict[str, Any]) -> dict[str, Any]:
    """This rank's partitions and optimizer state, and the JSON hyper-parameters."""
    opt = engine.optimizer
    base, flats = opt.optimizer, flat_partitions(opt)
    _create_state(opt, flats)
    groups = {f"group{i}": {"fp32": f, **{k: v for k, v in base.state.get(f, {}).items()
                                          if torch.is_tensor(v)}}
              for i, f in enumerate(flats)}
    scaler = getattr(opt, "loss_scaler", None)
    groups["loss_scale"] = {k: torch.tensor(float(getattr(scaler, k)), dtype=torch.float64)
                            for k in SCALER if isinstance(getattr(scaler, k, None), (int, float))}
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, LAYOUT: saved_layout}
                    for g in base.param_groups]
    return {"state": {f"rank{rank}": groups}, "param_groups": param_groups}


@torch.no_grad()
def load(engine: Any, stage: int, rank: int, model_sd: dict[str, Any],
         optim_sd: dict[str, Any]) -> None:
    """Put back what DCP has filled into the tensors of model_sd and optim_state (the partitions
    and optimizer state are already in place): DeepSpeed's low-precision weights from them, the
    buffers, the loss scale and the hyper-parameters."""
    opt, module = engine.optimizer, engine.module
    if stage == 3:  # what DeepSpeed's own load does after its optimizer state is back
        opt.checkpoint_event_prologue()  # every parameter partitioned
        for i in range(len(flat_partitions(opt))):
            opt._reassign_or_swap_out_partitioned_parameters(i)  # fp32 -> working dtype
        if opt.persistent_parameters:
            opt.persistent_parameters[0].partition(opt.persistent_parameters)
        opt.checkpoint_event_epilogue()  # the small parameters ZeRO 3 keeps whole: gathered
    else:  # every rank holds the whole working-dtype weights: the gathered fp32 ones, cast
        for name, p in module.named_parameters():
            p.data.copy_(model_sd[name])
    for name, b in module.named_buffers():
        if name in model_sd:
            b.copy_(model_sd[name])
    scaler = getattr(opt, "loss_scaler", None)
    for key, value in optim_sd["state"][f"rank{rank}"]["loss_scale"].items():
        old = getattr(scaler, key)
        setattr(scaler, key, type(old)(value.item()))
    for group, saved in zip(opt.optimizer.param_groups, optim_sd["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k not in ("params", LAYOUT)})


# ----------------------------------------------------------------- refusing another layout
def resume_manifest(cfg: Config) -> tuple[Path, dict[str, Any]] | None:
    """The manifest of the checkpoint a resume would read (resume=auto: the newest complete one),
    None when there is none or it cannot be read (the resume then says why)."""
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        found = complete_checkpoints(cfg.run.run_dir, warn=False)
        if not found:
            return None
        path = found[-1][1]
    else:
        path = Path(cfg.resume)
    manifest = manifest_json(path)
    return None if manifest is None else (path, manifest)


def check_resume(cfg: Config, current: dict[str, Any]) -> None:
    """Refuse, in one line, to resume from a checkpoint whose optimizer state is not in this run's
    layout: another strategy's (per-parameter state), another ZeRO stage, world size or
    partitioning."""
    found = resume_manifest(cfg)
    if found is None:
        return
    path, manifest = found
    strategy = manifest.get("strategy")
    if strategy != "deepspeed":
        raise ConfigError(
            f"checkpoint '{path}' was written by strategy {strategy}, and strategy deepspeed "
            "resumes only its own checkpoints (its optimizer state is DeepSpeed's per-rank "
            f"partitions); fix: resume it with strategy.name={strategy}, or "
            f"{start_over(cfg.run.run_dir)}")
    groups = manifest.get("param_groups") or [{}]
    saved = groups[0].get(LAYOUT) if isinstance(groups[0], dict) else None
    if not isinstance(saved, dict):
        return  # not written by this module: DCP's own checks speak
    differs, fixes = [], []
    for key, now in current.items():
        was = saved.get(key)
        if was == now:
            continue
        if key == "zero_stage":
            differs.append(f"ZeRO stage {was} (this run: {now})")
            fixes.append(f"strategy.deepspeed.zero_stage={was}")
        elif key == "world_size":
            differs.append(f"{was} ranks (this run: {now})")
            fixes.append(f"{was} ranks (e.g. --nproc-per-node {was})")
        else:
            differs.append(f"zero_optimization.{key}={json.dumps(was)} (this run: {json.dumps(now)})")
            fixes.append(f"zero_optimization.{key}={json.dumps(was)} in the DeepSpeed JSON")
    if differs:
        raise ConfigError(
            f"checkpoint '{path}' holds DeepSpeed partitions for {', '.join(differs)}, which load "
            f"only into the layout that wrote them; fix: resume with {' and '.join(fixes)}, or "
            f"{start_over(cfg.run.run_dir)}")
