"""`dtlab advise --cluster`: the layouts of N GPUs searched, screened, and the best traced.

Every layout a run could take is a candidate: the data-parallel strategies (ddp, zero1, fsdp,
hsdp, ...) and FLAVOUR@ppP.tpT with the tensor-parallel degree inside a node, the pipeline degree
dividing what is left, and for pipelines the microbatch counts P, 2P and 4P. dtlab's own checks
refuse what cannot run (each refusal is listed with its reason). The rest are screened in
milliseconds by a model of the step (`screen`): compute at the cluster's efficiency, recomputation
under activation checkpointing, the 1F1B bubble (P-1)/M of it, tensor parallelism's collectives
(exposed: they sit between a block's matrix multiplies), the data-parallel reduction beyond what
the compute hides, and per-rank memory (the state of P/(pp x tp) parameters as the flavour shards
it, and the activations of the microbatches in flight, divided over the tensor-parallel ranks).
The fastest that fit are then traced and priced by `dtlab predict` (its own memory and time),
within a time budget: the ranking is predict's, the screen only chooses what to trace.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from dtlab.config.strategies.layout_syntax import Layout
from dtlab.errors import ConfigError, DtlabError

FLAVOURS = ("fsdp", "ddp")  # over the ranks a model-parallel layout leaves
SHARDED = {"fsdp": ("params", "grads", "master", "optimizer"), "zero1": ("master", "optimizer")}


@dataclass
class Candidate:
    layout: str  # FLAVOUR@ppP.tpT, or a data-parallel strategy token
    pp: int = 1
    tp: int = 1
    microbatches: int | None = None
    why_not: str | None = None  # dtlab's refusal
    rough: dict[str, float] = dataclasses.field(default_factory=dict)
    predicted: dict[str, Any] | None = None

    @property
    def overrides(self) -> list[str]:
        return [f"strategy.pp.microbatches={self.microbatches}"] if self.microbatches else []

    @property
    def label(self) -> str:
        return self.layout + (f" m={self.microbatches}" if self.microbatches else "")


def _powers_of_two(most: int) -> list[int]:
    return [1 << i for i in range(most.bit_length()) if 1 << i <= most]


def candidates(gpus: int, per_node: int, n_layer: int | None, data_parallel: list[str],
               batch: int) -> list[Candidate]:
    """Every layout of `gpus` ranks searched: the data-parallel strategies, then model-parallel
    degrees (tp within a node; pp up to the blocks; both dividing the ranks), for pipelines the
    microbatch counts that split each replica's `batch` / dp samples."""
    out = [Candidate(token) for token in data_parallel]
    for tp in _powers_of_two(min(per_node, gpus)):
        for pp in _powers_of_two(gpus // tp):
            if tp * pp == 1 or (n_layer is not None and pp > n_layer) or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for flavour in ("single",) if dp == 1 else FLAVOURS:
                text = Layout(flavour, pp=pp, tp=tp).text()
                counts = [m for m in (pp, 2 * pp, 4 * pp) if (batch // dp) % m == 0] or [pp]
                out += [Candidate(text, pp, tp, m) for m in counts] if pp > 1 \
                    else [Candidate(text, pp, tp)]
    return out


def screen(c: Candidate, cfg: Any, req: Any, n_params: float, flops: float,
           act_per_sample: float | None) -> None:
    """The step's rough time and memory per rank (see the module's docstring) into c.rough."""
    from dtlab.estimate.core import optimizer_of, precision_of
    from dtlab.estimate.memory import OPTIMIZER_BYTES
    from dtlab.predict.roofline import peak_tflops

    cl, world, per_node = req.cluster, req.world, req.ranks_per_node
    dp = world // (c.pp * c.tp)
    flavour = c.layout.partition("@")[0]
    t, prec = cfg.train, precision_of(cfg)
    held = n_params / (c.pp * c.tp)
    full = {"params": prec.weight, "grads": prec.grad, "master": prec.master,
            "optimizer": OPTIMIZER_BYTES[optimizer_of(cfg)]}
    shard = SHARDED.get("fsdp" if flavour == "hsdp" else flavour, ())
    shards = min(dp, max(1, per_node // c.tp)) if flavour == "hsdp" else dp  # hsdp: in a node
    state = sum(held * b / (shards if k in shard else 1) for k, b in full.items())
    m = c.microbatches or 1
    in_flight = min(m, c.pp) / c.pp if c.pp > 1 else 1.0  # 1F1B: the first stage's share
    micro = t.global_batch_size / (dp * t.grad_accum_steps * m)  # samples per microbatch
    act = act_per_sample * micro * in_flight / c.tp if act_per_sample is not None else None
    if act is not None and prec.mixed and (flavour not in ("fsdp", "hsdp") or dp == 1):
        act += held * prec.compute  # autocast's 16-bit copies of the weights it holds
    peak, _ = peak_tflops(cl, t.precision, req.threads or 1)
    recompute = 4 / 3 if t.activation_checkpointing == "full" else 1.0
    compute = flops * recompute / world / (peak * 1e12 * cl.compute_efficiency)
    bubble = compute * (c.pp - 1) / m
    seq, hidden, layers = _shape(cfg)
    act_bytes = 2 if t.precision != "fp32" else 4
    tp_comm = 0.0
    if c.tp > 1 and cl.intra.bus_bytes_per_s:  # 4 gathers/scatters forward, 4 backward, per block
        size = micro * seq * hidden * act_bytes * (c.tp - 1) / c.tp
        tp_comm = layers / c.pp * m * t.grad_accum_steps * 8 * size / cl.intra.bus_bytes_per_s
    link = cl.intra if c.tp * dp <= per_node else cl.inter
    dp_comm = 0.0
    if dp > 1 and link.bus_bytes_per_s:
        # fsdp: parameters gathered forward and backward, gradients reduce-scattered; zero1:
        # gradients all-reduced, updated parameters gathered; ddp: gradients all-reduced
        moved = {"fsdp": 2 * prec.compute + prec.reduce, "hsdp": 2 * prec.compute + prec.reduce,
                 "zero1": 2 * prec.reduce + prec.weight}.get(flavour, 2 * prec.reduce)
        dp_comm = held * moved * (dp - 1) / dp / link.bus_bytes_per_s
    step = compute + bubble + tp_comm + max(0.0, dp_comm - compute)
    c.rough = {"step_s": step, "compute_s": compute, "bubble_s": bubble, "tp_comm_s": tp_comm,
               "dp_comm_exposed_s": max(0.0, dp_comm - compute), "state_bytes": state,
               "activation_bytes": act if act is not None else float("nan"),
               "device_bytes": state + (act or 0.0)}


def _shape(cfg: Any) -> tuple[int, int, int]:
    """(sequence, hidden size, blocks) of the config's language model (0s for others)."""
    m = cfg.model
    if m.name == "gpt":
        return m.block_size, m.n_embd, m.n_layer
    if m.name == "hf":
        from dtlab.config.transformers_config import hf_config

        h = hf_config(m)
        return m.block_size, getattr(h, "hidden_size", 0), getattr(h, "num_hidden_layers", 0)
    return 0, 0, 0


def search(req: Any, data_parallel: list[str], budget_s: float, memory: float,
           most: int = 4) -> list[Candidate]:
    """Every candidate: refused (why_not), screened (rough), and the fastest that fit `memory`
    bytes per rank by the screen traced by predict (predicted), at most `most` of them, within
    budget_s seconds (at least one); ordered by predicted step time, then the screened rest,
    then the refused."""
    from dtlab.estimate.core import model_from_config
    from dtlab.predict.core import model_flops, model_params, predict, strategy_config

    base = strategy_config(req, data_parallel[0]) if data_parallel else None
    if base is None:
        raise DtlabError("no data-parallel strategy runs this config; fix: check it with "
                         "dtlab train first")
    seq, _, n_layer = _shape(base)
    found = candidates(req.world, req.ranks_per_node, n_layer or None, data_parallel,
                       base.train.global_batch_size // base.train.grad_accum_steps)
    n_params, flops = float(model_params(base)), model_flops(base)
    model = model_from_config(req.path, req.overrides)
    act_per_sample = None  # the whole model's activations at the peak, per sample of a microbatch
    if model.segments is not None:
        from dtlab.estimate import activations
        from dtlab.estimate.cli import config_checkpointing

        # 16-bit activations without autocast's weight copies (screen adds those per layout)
        mode = "fp32" if base.train.precision == "fp32" else "half"
        act_per_sample = activations.walk(model.segments(1, mode),
                                          config_checkpointing(model)).peak
    for c in found:
        try:
            cfg = strategy_config(dataclasses.replace(req, overrides=[*req.overrides,
                                                                      *c.overrides]), c.layout)
        except (ConfigError, DtlabError) as e:
            c.why_not = str(e).partition(": ")[2] if str(e).startswith("--strategies") else str(e)
            continue
        screen(c, cfg, req, n_params, flops, act_per_sample)
    fits = sorted((c for c in found if c.rough and c.rough["device_bytes"] <= memory),
                  key=lambda c: c.rough["step_s"])
    start = time.monotonic()
    for c in fits[:most]:
        if c is not fits[0] and time.monotonic() - start > budget_s:
            break
        try:
            c.predicted = predict(dataclasses.replace(req, overrides=[*req.overrides,
                                                                     *c.overrides]), c.layout)
        except (ConfigError, DtlabError) as e:
            c.why_not = str(e)
    traced = sorted((c for c in found if c.predicted), key=lambda c: c.predicted["step_s"])
    screened = sorted((c for c in found if c.rough and not c.predicted and not c.why_not),
                      key=lambda c: c.rough["step_s"])
    return traced + screened + [c for c in found if c.why_not]
