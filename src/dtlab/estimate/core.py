"""One estimate: a model, a world, a precision and optimizer, a strategy -> the numbers per rank.

A model comes from a dtlab config (the state of dtlab's strategies is then measured under the
fake backend, measure.py, or for DeepSpeed modelled, deepspeed_layout.py) or from a parameter
count, with a GPT shape for activations and sharding units: given, or by the rule hidden = 128 x
n_layer, n_layer = floor((P / (12 x 128^2))^(1/3)) (the shapes of LLaMA-7B and GPT-3 175B).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtlab.config import Config
from dtlab.estimate import activations, comm, memory
from dtlab.estimate.measure import NotMeasured, RankBytes, measure, measured_strategies, meta_model
from dtlab.estimate.memory import OPTIMIZER_BYTES, PRECISIONS, Plan, Precision

MEASURED, DEEPSPEED = "measured (fake backend)", "modelled (DeepSpeed 0.19.8 layout)"
IDEAL = "modelled (ideal layout)"  # the sources of a row's state bytes


@dataclass
class Model:
    name: str
    n_params: float
    units: list[float]  # parameter counts of the sharding units: the blocks
    root: float = 0.0  # parameters no block holds (embeddings, head): the root unit
    segments: Callable[[int, str], list[activations.Segment]] | None = None  # (micro, mode)
    cfg: Config | None = None
    source: tuple[str | None, list[str]] = (None, [])  # the config's file and overrides
    notes: list[str] = field(default_factory=list)


def gpt_shape(n_params: float) -> tuple[int, int]:
    """(n_layer, hidden) of a GPT with about n_params parameters, by the hidden = 128 L rule."""
    n_layer = max(1, math.floor((n_params / (12 * 128 * 128)) ** (1 / 3)))
    return n_layer, 128 * n_layer


def model_from_size(n_params: float, n_layer: int | None, hidden: int | None,
                    n_head: int | None, seq_len: int | None, vocab: int) -> Model:
    notes = []
    if n_layer is None or hidden is None:
        n_layer = n_layer or gpt_shape(n_params)[0]
        hidden = hidden or 128 * n_layer
        notes.append(f"shape by the hidden = 128 x layers rule: {n_layer} layers x {hidden}")
    heads = n_head or max(1, hidden // 128)
    block = 12 * hidden * hidden + 12 * hidden
    units, root = [float(block)] * n_layer, max(0.0, n_params - n_layer * block)
    if n_params < n_layer * block:
        units = [n_params / n_layer] * n_layer
        notes.append(f"{n_layer} layers x {hidden} hold more than {n_params:.3g} parameters: "
                     "sharding units taken as equal parts")
    segments = None
    if seq_len:
        def segments(micro: int, mode: str) -> list[activations.Segment]:
            return activations.gpt_segments(n_layer, hidden, heads, seq_len, vocab, micro, mode)
        notes.append(f"activations of a GPT block (4x MLP, flash attention, no dropout), "
                     f"{heads} heads, vocabulary {vocab}, sequence {seq_len}")
    return Model(f"{n_params:.3g} parameters", float(n_params), units, root, segments, notes=notes)


def model_from_config(path: str | None, overrides: list[str]) -> Model:
    from dtlab.config import load_config

    cfg = load_config(path, overrides)
    model, taken, units = meta_model(cfg), set(), []
    for block in model.blocks():  # FSDP's units: each block's parameters no earlier one took
        units.append(float(sum(p.numel() for p in block.parameters() if id(p) not in taken)))
        taken |= {id(p) for p in block.parameters()}
    n = float(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
    return Model(f"{cfg.model.name} ({int(n):,} parameters)", n, [u for u in units if u],
                 n - sum(units), lambda micro, mode: activations.config_segments(cfg, micro, mode),
                 cfg, (path, list(overrides)))


def backend_of(cfg: Config) -> str:
    """The backend a dtlab run of `cfg` would use (dtlab/distributed.py's choice)."""
    import torch

    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    return cfg.run.backend if cfg.run.backend != "auto" else "nccl" if cuda else "gloo"


def optimizer_of(cfg: Config) -> str:
    t = cfg.train
    return "adamw" if t.optimizer == "adamw" else "sgd-momentum" if t.momentum > 0 else "sgd"


def precision_of(cfg: Config) -> Precision:
    """What dtlab's strategies hold: fp32 state; bf16/fp16 only in compute (and reductions,
    with strategy.fsdp[1].reduce_fp32=false). DeepSpeed: 16-bit weights, fp32 master."""
    p, s = cfg.train.precision, cfg.strategy
    if p == "fp32" or s.name == "deepspeed":
        return PRECISIONS[p]
    options = {"fsdp": s.fsdp, "fsdp1": s.fsdp1}.get(s.name)
    return replace(PRECISIONS[f"{p}-autocast"], **({} if options is None or options.reduce_fp32
                                                   else {"reduce": 2}))


def plan_of(cfg: Config, label: str, ranks_per_node: int) -> Plan | None:
    """The ideal layout a dtlab strategy corresponds to, for its temporaries and communication;
    None for tensor and pipeline parallelism, which no layout here describes."""
    s, offload, group = cfg.strategy, False, None
    kind = {"single": "ddp", "ddp": "ddp", "zero1": "zero1",
            "fsdp": "zero3" if s.fsdp.reshard_after_forward else "zero2"}.get(s.name)
    if s.name in ("fsdp", "fsdp1"):
        offload = getattr(s, s.name).cpu_offload
    if s.name == "fsdp1":
        kind = {"SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp"}.get(s.fsdp1.sharding_strategy, "zero3")
        if s.fsdp1.sharding_strategy == "HYBRID_SHARD":
            group = s.fsdp1.shard_group_size or ranks_per_node
    if s.name == "deepspeed":
        from dtlab.estimate.deepspeed_layout import zero_stage

        kind = f"zero{zero_stage(cfg)}"
    return Plan(kind, offload, group, label) if kind else None


def exact_state(cfg: Config, world: int, ranks_per_node: int,
                device: str = "cpu") -> list[RankBytes]:
    """Per-rank param/grad/optim bytes of `cfg`'s strategy on `world` ranks: measured under the
    fake backend (every rank up to 16, else the ranks holding the most), or DeepSpeed's model."""
    if cfg.strategy.name == "deepspeed":
        from dtlab.estimate.deepspeed_layout import deepspeed_state

        numels = [p.numel() for p in {id(p): p for p in meta_model(cfg).parameters()}.values()]
        return deepspeed_state(numels, cfg, world, device)
    if cfg.strategy.name not in measured_strategies():
        raise NotMeasured(f"strategy '{cfg.strategy.name}' is not measured here")
    return measure(cfg, world, ranks_per_node, device)


@dataclass
class Setup:
    model: Model
    world: int
    ranks_per_node: int
    precision: Precision
    optimizer: str
    micro: int = 1
    checkpointing: bool = False
    links: comm.Links | None = None
    backend: str = "nccl"  # gloo runs reduce-scatter as an all-reduce (comm.collectives)


def activation_mode(precision: Precision, wrapper_casts: bool) -> str:
    """fp32; `half` when the weights themselves are 16-bit in compute (master-weight training, or
    FSDP gathering them in 16 bits); else autocast."""
    return "fp32" if not precision.mixed else "half" if precision.master or wrapper_casts else "autocast"


def strategy_config(setup: Setup, token: str) -> Config | None:
    """The config of a dtlab strategy spec (fsdp1:SHARD_GRAD_OP...) on the setup's model; None
    for the ideal layouts (zero2, hybrid:4...) or a model given by its parameter count."""
    from dtlab.compare import parse_spec
    from dtlab.config import load_config
    from dtlab.errors import ConfigError

    try:
        path, overrides = setup.model.source
        return None if setup.model.cfg is None else load_config(path, [*overrides, *parse_spec(token)])
    except ConfigError:
        return None


def estimate(setup: Setup, token: str) -> dict[str, Any]:
    """One row: the bytes per rank of `token`'s strategy (see memory.parse_plan, or a dtlab
    strategy spec like fsdp1:SHARD_GRAD_OP when the model comes from a config)."""
    import torch

    m, world, rpn = setup.model, setup.world, setup.ranks_per_node
    cfg = strategy_config(setup, token)
    name = cfg and cfg.strategy.name
    plan = memory.parse_plan(token, world, rpn) if cfg is None else plan_of(cfg, token, rpn)
    precision = setup.precision if cfg is None else precision_of(cfg)
    per_rank, source, notes, held = None, IDEAL, [], {}
    if cfg is not None:
        device = "cuda" if setup.backend == "nccl" and torch.cuda.is_available() else "cpu"
        try:
            per_rank = exact_state(cfg, world, rpn, device)
            source = DEEPSPEED if name == "deepspeed" else MEASURED
        except NotMeasured as e:
            if plan is None:
                raise
            notes.append(f"{token}: not measured ({e}); the ideal {plan.kind} layout instead")
    if per_rank is None:
        state = memory.state_per_rank(m.n_params, plan, precision, setup.optimizer, world)
    else:
        held = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "rank"}
        master = held.get("master_bytes", 0)  # DeepSpeed: inside optim_bytes, shown apart
        state = memory.State(held["param_bytes"], held["grad_bytes"], master,
                             held["optim_bytes"] - master, 0.0)
        if "host_bytes" in held:  # DeepSpeed: what its offload keeps in host memory
            state = replace(state, offloaded=held["host_bytes"])
            plan = replace(plan, offload=plan.offload or held["host_bytes"] > 0)
        elif plan is not None and plan.offload:
            state = replace(state, offloaded=state.total)  # FSDP offloads all of its shards
    row: dict[str, Any] = {
        "strategy": token, "layout": plan.kind + "+offload" * plan.offload if plan else name,
        "shards": plan and plan.shards(world), "exact": per_rank is not None, "source": source,
        "params": state.params, "grads": state.grads, "master": state.master,
        "optimizer": state.optimizer, "state": state.total,
        "host": state.offloaded + held.get("host_buffer_bytes", 0),
        **({"per_rank": per_rank} if per_rank else {}), "temporaries": {}, "comm": None}
    if plan is None:  # tp, fsdp_tp, pp: the state is measured, the rest not modelled
        notes.append(f"{token}: temporaries, activations and communication of tensor and "
                     "pipeline parallelism are not modelled (shown as 0 and -)")
        return {**row, "device_total": state.device, "notes": notes}
    temps = row["temporaries"] = memory.temporaries(
        m.n_params, max(m.units, default=0.0), m.root, plan, precision, world,
        gathers_all=plan.kind == "zero2" and name not in (None, "deepspeed"))
    if name == "deepspeed":  # its buckets and staging buffers, whatever the model size
        temps.update(buffers=held["buffer_bytes"] - held["host_buffer_bytes"],
                     backward_buckets=held["backward_buffer_bytes"])
    act = None
    if m.segments is not None:
        from dtlab.strategies import strategy_class

        casts = plan.kind == "zero3" if name is None else strategy_class(name).wrapper_casts
        mode = activation_mode(precision, casts)
        act = activations.walk(m.segments(setup.micro, mode), setup.checkpointing)
        row["activations"] = {"saved": act.saved, "peak": act.peak, "mode": mode}
    row["device_total"] = state.device + sum(temps.values()) + (act.peak if act else 0.0)
    calls = comm.collectives(plan, m.units, precision, world, rpn, name is None or
                             plan.kind != "zero2", name == "zero1", setup.backend, m.root,
                             name != "fsdp1")  # FSDP1 keeps its root unit gathered
    row["comm"] = {**comm.summarize(calls, setup.links),
                   "host_device_bytes": comm.offload_bytes(plan, m.n_params, precision, world)}
    return {**row, "notes": notes} if notes else row


def describe(setup: Setup) -> str:
    p = setup.precision
    return (f"{setup.model.name}, {setup.world} ranks ({setup.ranks_per_node} per node), "
            f"{setup.optimizer} ({OPTIMIZER_BYTES[setup.optimizer]} B/param of state), "
            f"{p.name} (weights {p.weight} B, grads {p.grad} B, master {p.master} B), "
            f"micro batch {setup.micro}, {setup.backend}, activation checkpointing "
            f"{'on' if setup.checkpointing else 'off'}")
