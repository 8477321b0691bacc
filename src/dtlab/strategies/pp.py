"""Pipeline parallelism for the GPT (`pp`), with `torch.distributed.pipelining`.

The GPT's blocks are split by hand into S = degree x stages_per_rank contiguous stages (as even as
possible); stage 0 also holds the embeddings, the last stage the final norm and head. Stage s runs
on pipeline rank s % degree (one stage per rank for gpipe and 1f1b; several, looping, for
interleaved_1f1b and looped_bfs). A stage is a `GPT.part`: it shares the GPT's modules, so each
rank's model keeps the whole model's parameter names for what it holds, and holds nothing else.

Each rank's micro batch is split into `microbatches`; the schedule sends activations forward and
their gradients backward point-to-point between neighbouring stages. Only the last stage computes
losses. With world size > degree the ranks form a mesh (dp, pp) and the replicas of each stage
synchronise with FSDP2 or DDP over dp (`strategy.pp.dp`). With `strategy.pp.tp` > 1 (the layout
fsdp@pp2.tp2) each stage is also tensor-parallel, on a (pp, dp, tp) mesh: pp_tp.py.

The pipeline bubble is measured: each stage's forward and backward calls are timed (busy time);
the bubble is 1 - busy / wall time of the schedule's step, per rank, against the theory
(p - 1) / (v m + p - 1) for p ranks, v stages per rank and m microbatches (equal stage costs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from dtlab.config.strategies.pp_spec import MULTI_STAGE_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE
from dtlab.config.strategies.pp_spec import degree as pipeline_degree
from dtlab.data import EvalLoader
from dtlab.models import loss_fn
from dtlab.strategies import pp_tp
from dtlab.strategies.base import (
    DTYPES,
    LossHook,
    StepEngine,
    Strategy,
    eval_totals,
    full_value,
)
from dtlab.strategies.fsdp import shard

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B, "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def split_blocks(names: list[str], n_stages: int) -> list[list[str]]:
    """Contiguous block names per stage, sizes differing by at most one."""
    n = len(names)
    return [names[s * n // n_stages:(s + 1) * n // n_stages] for s in range(n_stages)]


def dims(cfg: Any) -> tuple[int, int, int]:
    """(sequence, hidden size, vocabulary) of the model a pipeline passes between stages."""
    m = cfg.model
    if m.name == "hf":
        from dtlab.config.transformers_config import hf_config

        config = hf_config(m)
        return m.block_size, config.hidden_size, config.vocab_size
    return m.block_size, m.n_embd, m.vocab_size


class PP(Strategy):
    # --- splitting ------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        cfg, ctx, o = self.cfg, self.ctx, self.cfg.strategy.pp
        self.degree, self.tp = pipeline_degree(cfg, ctx.world_size), o.tp
        self.per_rank, self.microbatches = o.stages_each(), o.microbatches
        self.n_stages = self.degree * self.per_rank
        mesh = pp_tp.mesh(ctx.device.type, ctx.world_size, self.degree, self.tp)
        self.dp_mesh, self.pp_group = mesh["dp"], mesh.get_group("pp")
        self.tp_mesh = mesh["tp"] if self.tp > 1 else None
        # the rank of a tensor-parallel group that reports what its group computed alike
        self.reports = self.tp_mesh is None or self.tp_mesh.get_local_rank() == 0
        self.pp_rank = mesh["pp"].get_local_rank()
        self.stage_ids = [self.pp_rank, 2 * self.degree - 1 - self.pp_rank] \
            if o.schedule in V_SCHEDULES else \
            [self.pp_rank + i * self.degree for i in range(self.per_rank)]
        self.has_first, self.has_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        # FSDP's MixedPrecisionPolicy casts parameters and inputs when it syncs the replicas
        self.wrapper_casts = self.dp_size > 1 and o.dp == "fsdp"

        model = self.prepare(model)
        self.blocks = split_blocks(model.block_names(), self.n_stages)
        last = self.n_stages - 1
        mine = [b for s in self.stage_ids for b in self.blocks[s]]
        # This rank's model: its blocks (+ embeddings / head), the rest of the GPT is dropped.
        held = model.part(mine, self.has_first, self.has_last)
        if self.tp_mesh is not None:
            held = pp_tp.parallelize(model, held, self.tp_mesh)
        parts: list[nn.Module] = [held.part(self.blocks[s], s == 0, s == last)
                                  for s in self.stage_ids]
        if self.dp_size > 1:
            if o.dp == "fsdp":
                parts = [shard(p, self.dp_mesh, cfg.strategy.fsdp, self.precision, ctx.device)
                         for p in parts]
            else:
                dev = ctx.device
                parts = [DistributedDataParallel(
                    p, device_ids=[dev.index] if dev.type == "cuda" else None,
                    process_group=mesh.get_group("dp")) for p in parts]
        self.parts = parts
        self.stages = [PipelineStage(p, s, self.n_stages, ctx.device, group=self.pp_group,
                                     **self._shapes(s))
                       for p, s in zip(parts, self.stage_ids, strict=True)]
        return held

    def step_engine(self, model: nn.Module, forward: nn.Module,
                    optimizer: torch.optim.Optimizer) -> StepEngine:
        return PipelineStep(self, model, forward, optimizer)

    def _shapes(self, stage: int) -> dict[str, torch.Tensor]:
        """Each stage's input and output, given up front (meta tensors): the stage then skips
        its shape-inference pass (a real forward and backward that DDP cannot tell from a step).
        Token ids (b, T) into stage 0; hidden states (b, T, C) between stages; logits (b, T, V)
        out of the last."""
        seq, width, vocab = dims(self.cfg)
        b = self.cfg.train.global_batch_size // (
            self.dp_size * self.cfg.train.grad_accum_steps * self.microbatches)
        # requires_grad: the stage then sends (receives) the gradient of this tensor backward.
        hidden = torch.empty(b, seq // self.tp, width, dtype=self.hidden_dtype,
                             device="meta", requires_grad=True)  # a sequence shard per tp rank
        logits_dtype = DTYPES[self.precision]
        return {
            "input_args": torch.empty(b, seq, dtype=torch.long, device="meta")
            if stage == 0 else hidden,
            "output_args": torch.empty(b, seq, vocab // self.tp, dtype=logits_dtype,
                                       device="meta") if stage == self.n_stages - 1 else hidden,
        }

    @property
    def hidden_dtype(self) -> torch.dtype:
        """What stages pass on: fp32 under autocast (the residual stream stays fp32), the low
        precision itself under FSDP's MixedPrecisionPolicy (parameters and inputs are cast)."""
        return DTYPES[self.precision] if self.wrapper_casts else torch.float32

    # --- evaluation and state -----------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        """The global rank holding `stage`: looping (stage % degree), or the V's way back."""
        p = self.degree
        local = 2 * p - 1 - stage if self.cfg.strategy.pp.schedule in V_SCHEDULES and stage >= p \
            else stage % p
        return dist.get_global_rank(self.pp_group, local)

    @torch.no_grad()
    def evaluate(self, forward: nn.Module, loader: EvalLoader) -> dict[str, Any]:
        """Every evaluation batch goes through the stages in order, whole (no microbatches, no
        schedule: evaluation batches may differ in size from training's), activations sent
        point-to-point to the next stage's rank. Only the last stage adds to the totals: the
        sum over all ranks is the sum over the replicas."""
        for p in self.parts:
            p.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        width = dims(self.cfg)[1]
        for x, y, mask in loader:
            h = x
            for s, part in zip(self.stage_ids, self.parts, strict=True):
                if s > 0 and self._peer(s - 1) != self.ctx.rank:
                    h = torch.empty(x.shape[0], x.shape[1] // self.tp, width,
                                    dtype=self.hidden_dtype, device=self.ctx.device)
                    dist.recv(h, self._peer(s - 1))
                with self.autocast():
                    h = part(h)
                if s < self.n_stages - 1 and self._peer(s + 1) != self.ctx.rank:
                    dist.send(h.to(self.hidden_dtype).contiguous(), self._peer(s + 1))
            if self.has_last and self.reports:
                logits = h if self.tp_mesh is None else pp_tp.vocab_sharded(h, self.tp_mesh)
                totals += eval_totals(full_value(logits), y, mask)
            elif self.has_last:  # the other ranks of the head's group take part in the gather
                full_value(pp_tp.vocab_sharded(h, self.tp_mesh))
        self.reduce_sum(totals)
        for p in self.parts:
            p.train()
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   full: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """full=True: every stage's full state, gathered over the pipeline (the same names as the
        whole GPT's); full=False: this rank's own (DCP checkpoints merge the ranks' keys)."""
        model_sd, optim_sd = super().state_dict(model, optimizer, full)
        if not full:
            return model_sd, optim_sd
        if optimizer is not None:
            raise NotImplementedError("pp: a full optimizer state is not gathered")
        parts: list[Any] = [None] * self.degree
        dist.all_gather_object(parts, {k: v.cpu() for k, v in model_sd.items()},
                               group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()}, {}

    def in_one_process(self) -> AbstractContextManager[Any]:
        """A trace's ranks exist in this process alone: the schedule's first step would hold a
        vote between the stages over sends whose values a recording group does not deliver.
        Its outcome is known: every stage here gives its shapes and passes plain tensors, so
        each votes for static metadata, as between real ranks."""
        return mock.patch.object(_PipelineSchedule, "_warmup_p2p", _static_metadata)

    def describe(self) -> dict[str, Any]:
        o = self.cfg.strategy.pp
        mesh = {"dp": self.dp_size, "pp": self.degree} if self.tp == 1 else \
            {"pp": self.degree, "dp": self.dp_size, "tp": self.tp}
        return {"mesh": mesh, "schedule": o.schedule,
                "microbatches": o.microbatches, "stages_per_rank": self.per_rank,
                "dp": o.dp if self.dp_size > 1 else "none"}


def _static_metadata(schedule: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


class PipelineStep(StepEngine):
    """The schedule owns each micro batch's forward and backward: it splits the batch into
    microbatches and sends activations and their gradients between the stages. The gradient
    norm sums the stages' squares over the pipeline; the bubble: see the module's docstring."""

    def __init__(self, strategy: PP, model: nn.Module, forward: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        super().__init__(strategy, model, forward, optimizer)
        self.pp, self.ctx = strategy, strategy.ctx
        self.busy_s = 0.0
        self.timings: list[tuple[float, float]] = []  # (busy, wall) of each schedule step
        self._hook: LossHook | None = None
        self._reports: list[torch.Tensor] = []
        for stage in strategy.stages:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, method, self._timed(getattr(stage, method)))
        cls = SCHEDULES[strategy.cfg.strategy.pp.schedule]
        # scale_grads=False: the loss below is divided by the microbatches instead (dividing the
        # gradients after the step would also divide earlier accumulation micro steps' share).
        multi = strategy.cfg.strategy.pp.schedule in MULTI_STAGE_SCHEDULES
        self.schedule = cls(strategy.stages if multi else strategy.stages[0],
                            n_microbatches=strategy.microbatches,
                            loss_fn=self._loss, scale_grads=False)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.ctx.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ctx.synchronize()
                self.busy_s += time.perf_counter() - t0
        return timed

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each microbatch's loss on the last stage: its share of the micro batch's mean."""
        assert self._hook is not None
        if self.pp.tp_mesh is not None:  # the vocabulary shard: loss_parallel's cross-entropy
            logits = pp_tp.vocab_sharded(logits, self.pp.tp_mesh)
        report, root = self._hook(loss_fn(logits, y))
        self._reports.append(full_value(report).detach())
        return full_value(root) / self.pp.microbatches

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, loss_hook: LossHook,
                   sync: bool) -> torch.Tensor:
        self._hook, self._reports = loss_hook, []
        pp = self.pp
        self.busy_s = 0.0
        self.ctx.synchronize()
        t0 = time.perf_counter()
        with pp.autocast(), loss_parallel() if pp.tp_mesh is not None else nullcontext():
            self.schedule.step(*((x,) if pp.has_first else ()),
                               target=y if pp.has_last else None, return_outputs=False)
        self.ctx.synchronize()
        self.timings.append((self.busy_s, time.perf_counter() - t0))
        # not the last stage, or another rank of its tensor-parallel group: no loss here (a sum
        # over ranks counts 0)
        if not self._reports or not pp.reports:
            return torch.zeros((), device=self.ctx.device)
        return torch.stack(self._reports).sum() / pp.microbatches

    def grad_norm(self, clip: float) -> torch.Tensor | None:
        """sqrt of the sum over the pipeline's stages of each stage's squared norm (the same value
        on every rank); FSDP's DTensor norms are first reduced over dp by full_value."""
        squared = self.pp.grad_norm(self.model).to(self.ctx.device, torch.float64) ** 2
        dist.all_reduce(squared, group=self.pp.pp_group)
        norm = squared.sqrt().float()
        if clip:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), clip, norm)
        return norm

    def measurements(self) -> dict[str, Any]:
        """The pipeline bubble, measured per rank over the timed steps, and the theory."""
        pp = self.pp
        warm = pp.cfg.run.timing_warmup_steps * pp.cfg.train.grad_accum_steps
        timed = self.timings[warm:] or self.timings
        busy, wall = sum(b for b, _ in timed), sum(w for _, w in timed)
        per_rank = self.ctx.gather_floats([busy / max(len(timed), 1), wall / max(len(timed), 1)])
        bubbles = [1 - b / w if w else 0.0 for b, w in per_rank]
        p, v, m = pp.degree, pp.per_rank, pp.microbatches
        return {"pipeline": {
            "schedule": pp.cfg.strategy.pp.schedule, "ranks": p, "stages_per_rank": v,
            "stages": pp.n_stages, "microbatches": m,
            "blocks_per_stage": [len(b) for b in pp.blocks],
            # equal stage costs, backward as one piece; zero bubble schedules fill part of it
            # with the weights' gradients, so there the measured bubble is the number
            "bubble_theory": None if pp.cfg.strategy.pp.schedule in ZERO_BUBBLE
            else (p - 1) / (v * m + p - 1),
            "bubble_measured": sum(bubbles) / len(bubbles),
            "bubble_measured_per_rank": bubbles,
            "busy_s_per_step_per_rank": [b for b, _ in per_rank],
            "wall_s_per_step_per_rank": [w for _, w in per_rank],
        }}
