"""DeepSpeed ZeRO 1/2/3 (optionally offloaded to host memory or NVMe) behind dtlab's strategy interface.

The engine runs inside dtlab's loop: dtlab's process group (DeepSpeed sees it is initialised and
neither re-initialises it nor looks for MPI), dtlab's data, dtlab's torch optimizer (DeepSpeed
partitions its state) and LambdaLR (it sets the lr of that optimizer, which DeepSpeed steps).
The config comes from deepspeed_config.py.

- ZeRO 1: optimizer state and fp32 master weights partitioned; gradients reduced at the step.
- ZeRO 2: gradients also partitioned: reduced bucket by bucket during backward, each rank keeps
  the part it updates.
- ZeRO 3: parameters partitioned too: gathered per module for its forward and backward.
The engine owns the step (DeepSpeedStep below): engine.backward on each micro batch, DeepSpeed's
global gradient norm for dtlab's non-finite check, engine.step (DeepSpeed clips with
train.grad_clip and skips a non-finite step by itself). Checkpoints: dtlab's DCP format, with the
partitions under per-rank keys (deepspeed_checkpoint.py). `deepspeed` is imported here only, so
dtlab works without the extra.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtlab.config.strategies.deepspeed_config import deepspeed_config, nvme_offloads
from dtlab.errors import ConfigError
from dtlab.levers.optim import build_optimizer
from dtlab.models import loss_fn
from dtlab.process.environment import variables_set
from dtlab.rundir.hints import start_over
from dtlab.strategies import deepspeed_checkpoint as ds_checkpoint
from dtlab.strategies import deepspeed_nvme as nvme
from dtlab.strategies.base import DTYPES, LossHook, StepEngine, Strategy
from dtlab.strategies.deepspeed_memory import held_bytes


def import_deepspeed(device: torch.device, shm_comm: bool) -> Any:
    # The device dtlab chose, not DeepSpeed's own probing (which warns on every CPU run).
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError:
        raise ConfigError("strategy.name=deepspeed needs the deepspeed package; "
                          "fix: pip install 'dtlab[deepspeed]'") from None
    log = logging.getLogger("DeepSpeed")
    log.setLevel(logging.WARNING)  # no INFO lines at init
    # dtlab hands it torch's SGD/AdamW on purpose, and tests them against `single`.
    log.addFilter(lambda record: "untested optimizer" not in record.getMessage())
    # DeepSpeed 0.19.8 calls an all-gather that torch 2.13 deprecates: once per rank per run.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)
    if not shm_comm:
        # DeepSpeed probes which C++ ops this machine can build (compiler checks) and, when the
        # shared-memory collectives are among them, JIT-compiles them with gcc inside init (about
        # 2 min here the first time). An empty table skips both: plain torch.distributed is used.
        deepspeed.ops.__compatible_ops__ = {}
    return deepspeed


class DeepSpeed(Strategy):
    wrapper_casts = True  # bf16/fp16: DeepSpeed keeps low-precision parameters itself

    def setup(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The engine, and the torch optimizer it steps over its fp32 partitions (dtlab's LambdaLR
        sets that optimizer's lr; dtlab never steps it directly)."""
        self.ds_config = deepspeed_config(self.cfg, self.ctx.world_size, self.ctx.device.type)
        self.layout = ds_checkpoint.layout(self.ds_config, self.ctx.world_size)
        # Before any collective: a checkpoint of another layout is refused by rank 0, in one line.
        ds_checkpoint.check_resume(self.cfg, self.layout)
        if nvme_offloads(self.ds_config) and ds_checkpoint.resume_manifest(self.cfg) is not None:
            raise ConfigError("resuming a checkpoint under NVMe offload fails inside DeepSpeed "
                              "(its swapped state is not restored); fix: resume it with "
                              "strategy.deepspeed.offload_device=cpu, or "
                              f"{start_over(self.cfg.run.run_dir)}")
        self.nvme = nvme.Swap.of(self.cfg, self.ds_config, self.ctx.rank)
        deepspeed = import_deepspeed(self.ctx.device, self.cfg.strategy.deepspeed.shm_comm)
        env = self.ctx.env  # DeepSpeed asserts LOCAL_RANK is set; a one-process run sets nothing
        for key, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank),
                           ("WORLD_SIZE", env.world_size)):
            os.environ.setdefault(key, str(value))
        model = self.prepare(model)
        if self.nvme:
            self.nvme.fit_buffers(model, self.ctx.world_size)
        optimizer = build_optimizer(model.parameters(), self.cfg.train)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=self.ds_config, dist_init_required=False)
        self.stage = self.engine.zero_optimization_stage()
        self.engine.set_gradient_accumulation_boundary(True)
        if self.precision != "fp32":
            cast_at_the_edges(self.engine.module, DTYPES[self.precision])
        self.held = HeldBytes(self.engine, self.nvme)
        return self.engine, optimizer

    def step_engine(self, model: nn.Module, forward: nn.Module,
                    optimizer: torch.optim.Optimizer) -> StepEngine:
        return DeepSpeedStep(self, model, forward, optimizer)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   full: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model: the fp32 master weights gathered into full tensors, with single's keys (every
        rank takes part). With the optimizer (full=False): this rank's own partitions and their
        optimizer state, under rank keys (deepspeed_checkpoint.py)."""
        model_sd = ds_checkpoint.full_model(self.engine)
        if optimizer is None:
            return model_sd, {}
        if full:
            raise NotImplementedError("deepspeed gives the optimizer state as local partitions only")
        return model_sd, ds_checkpoint.optim_state(self.engine, self.ctx.rank, self.layout)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        ds_checkpoint.load(self.engine, self.stage, self.ctx.rank, model_sd, optim_sd)

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The largest bytes per kind seen around the first two optimizer steps (not at the end:
        after an evaluation ZeRO 3 leaves the parameters gathered)."""
        return self.held.peak()

    def in_one_process(self) -> contextlib.AbstractContextManager[Any]:
        return deepspeed_in_one_process(self.ctx.env)

    def close(self) -> None:
        """NVMe offload: the engine is destroyed while the process group lives (DeepSpeed's swap
        handles abort the process at exit otherwise), then this rank's swap files are removed."""
        if getattr(self, "nvme", None) and hasattr(self, "engine"):
            self.engine.destroy()
            self.nvme.remove()

    def describe(self) -> dict[str, Any]:
        return {**self.cfg.strategy.deepspeed.model_dump(), "zero_stage": self.stage,
                "deepspeed_config": self.ds_config}


class DeepSpeedStep(StepEngine):
    """DeepSpeed's engine owns the step: engine.backward on each micro batch (a gradient
    accumulation boundary on the last one only), its own loss scaling (fp16), clipping
    (`gradient_clipping`, inside engine.step) and skipping of non-finite steps."""

    def __init__(self, strategy: DeepSpeed, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(strategy, model, forward, optimizer)
        self.engine, self.stage, self.scaler = strategy.engine, strategy.stage, None
        self.probes.append(strategy.held.record)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, loss_hook: LossHook,
                   sync: bool) -> torch.Tensor:
        # Not a boundary: ZeRO 1 keeps gradients local; ZeRO 2/3 still reduce them into the
        # owners' partitions (their design), accumulating there until the step.
        self.engine.set_gradient_accumulation_boundary(sync)
        try:
            report, root = loss_hook(loss_fn(self.forward(x), y))  # root: / grad_accum_steps
            self.engine.backward(root, scale_wrt_gas=False)  # fp16: DeepSpeed scales the loss
        finally:
            self.engine.set_gradient_accumulation_boundary(True)
        return report.detach()

    def grad_norm(self, clip: float) -> torch.Tensor | None:
        """DeepSpeed's global norm of the reduced gradients, before the clipping engine.step
        applies; None under fp16, where overflow is routine: DeepSpeed skips the step and lowers
        the scale (as torch's GradScaler does for the other strategies)."""
        if self.strategy.precision == "fp16":
            return None
        from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

        opt = self.engine.optimizer
        norm = (combine_grad_norm_groups(opt._get_norm_groups()) if self.stage == 3
                else opt.scaled_global_norm())
        norm = torch.as_tensor(norm, dtype=torch.float32).cpu() / float(opt.loss_scale)
        return torch.full((), float("inf")) if is_invalid_grad_norm(norm) else norm

    def step(self) -> None:
        self.engine.step()

    def skip(self) -> None:
        self.engine.step()  # DeepSpeed sees the same non-finite norm, skips and drops the gradients


def cast_at_the_edges(module: nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's bf16/fp16 modes cast the parameters, not the inputs: cast floating inputs to
    the parameter dtype, and the outputs back to fp32 for the loss (as autocast does)."""

    def inputs(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                     for a in args)

    def output(_: nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        return out.float()

    module.register_forward_pre_hook(inputs)
    module.register_forward_hook(output)


class HeldBytes:
    """Observes the first optimizer steps (a probe of dtlab/run/step.py): the bytes DeepSpeed holds
    per kind after each accumulation micro step (ZeRO 1 keeps unreduced gradients between them)
    and just before and after each step (before: all gradients; after: the optimizer state)."""

    STEPS = 2

    def __init__(self, engine: Any, swap: nvme.Swap | None = None) -> None:
        self.engine, self.swap, self._peak = engine, swap, {}

    def record(self, event: str, step: int) -> None:
        if step <= self.STEPS:
            held = held_bytes(self.engine)
            if self.swap:  # NVMe offload: this rank's swap files (disk, not memory)
                held["disk_bytes"] = self.swap.bytes()
            for key, value in held.items():
                self._peak[key] = max(self._peak.get(key, 0), value)

    def peak(self) -> dict[str, int]:
        if not self._peak:
            self.record("end", 0)
        return dict(self._peak)


@contextlib.contextmanager
def deepspeed_in_one_process(env: Any) -> Iterator[None]:
    """DeepSpeed under a fake process group, one engine after another in one process: the rank
    variables it reads are this rank's, and the process's own again afterwards, as is
    torch.nn.functional.linear, which ZeRO-3 replaces with its own; its groups
    are module globals (deepspeed.utils.groups), forgotten before and after so that an engine
    never finds a destroyed group; and ZeRO-3's checks that every rank holds the same ids
    (a broadcast from rank 0, compared) are made, so their collectives are issued, but a
    disagreement is ignored: no value crosses a fake group."""
    import deepspeed.runtime.zero.partition_parameters as partition
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed.runtime.zero import utils

    check = utils.assert_ints_same_as_other_ranks

    def issued_not_compared(ints: list[int]) -> None:
        with contextlib.suppress(RuntimeError):
            check(ints)

    modules = [m for m in (utils, partition, coordinator, stage3)
               if getattr(m, "assert_ints_same_as_other_ranks", None) is check]
    linear = torch.nn.functional.linear  # ZeRO-3 replaces it for good ("unless manually reset")
    ranks = {"LOCAL_RANK": env.local_rank, "RANK": env.rank, "WORLD_SIZE": env.world_size}
    forget_groups()
    for m in modules:
        m.assert_ints_same_as_other_ranks = issued_not_compared
    try:
        with variables_set({key: str(value) for key, value in ranks.items()}):
            yield
    finally:
        for m in modules:
            m.assert_ints_same_as_other_ranks = check
        torch.nn.functional.linear = linear
        forget_groups()


def forget_groups() -> None:
    """Clear the process groups DeepSpeed keeps in deepspeed.utils.groups' globals."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in vars(groups).items():
        if name.startswith("_") and name.endswith(("GROUP", "GROUP_RANKS")):
            if isinstance(value, dict):
                value.clear()
            elif name.isupper():
                setattr(groups, name, None)

