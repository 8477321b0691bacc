"""One estimate: a model, a world, a precision and optimizer, a strategy -> the numbers per rank.

A model comes from a dtlab config (built on the meta device: exact parameter shapes; the state of
dtlab's strategies is then measured under the fake backend, measured.py, or for DeepSpeed
modelled, deepspeed_layout.py) or from a parameter count, with a GPT shape for activations and
sharding units: given (--n-layer, --hidden) or by the rule hidden = 128 x n_layer, n_layer =
floor((P / (12 x 128^2))^(1/3)) (P ~ 12 n_layer hidden^2: LLaMA-7B 32 x 4096, GPT-3 96 x 12288).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtlab.config import Config
from dtlab.estimate import activations, comm, memory
from dtlab.estimate.measured import NotMeasured, RankBytes, measure, measured_strategies, meta_model
from dtlab.estimate.memory import OPTIMIZER_BYTES, PRECISIONS, Plan, Precision

MEASURED = "measured (fake backend)"  # the sources of a row's state bytes
DEEPSPEED = "modelled (DeepSpeed 0.19.8 layout)"
IDEAL = "modelled (ideal layout)"


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
    rest = n_params - n_layer * block
    units, root = [float(block)] * n_layer, max(0.0, rest)
    if rest < 0:
        units = [n_params / n_layer] * n_layer
        notes.append(f"{n_layer} layers x {hidden} hold more than {n_params:.3g} parameters: "
                     "sharding units taken as equal parts")
    segments = None
    if seq_len:
        def segments(micro: int, mode: str) -> list[activations.Segment]:
            return activations.gpt_segments(n_layer, hidden, heads, seq_len, vocab, micro, mode)
        notes.append(f"activations of a GPT block (4x MLP, flash attention, no dropout), "
                     f"{heads} heads, vocabulary {vocab}, sequence {seq_len}")
    return Model(f"{n_params:.3g} parameters", float(n_params), units, root, segments,
                 notes=notes)


def model_from_config(path: str | None, overrides: list[str]) -> Model:
    from dtlab.config import load_config

    cfg = load_config(path, overrides)
    model, taken, units = meta_model(cfg), set(), []
    for block in model.blocks():  # FSDP's units: each block's parameters no earlier one took
        units.append(float(sum(p.numel() for p in block.parameters() if id(p) not in taken)))
        taken |= {id(p) for p in block.parameters()}
    n = float(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))

    def segments(micro: int, mode: str) -> list[activations.Segment]:
        return activations.config_segments(cfg, micro, mode)

    return Model(f"{cfg.model.name} ({int(n):,} parameters)", n, [u for u in units if u],
                 n - sum(units), segments, cfg, (path, list(overrides)))


def backend_of(cfg: Config) -> str:
    """The backend a dtlab run of `cfg` would use (dtlab/distributed.py's choice)."""
    import torch

    if cfg.run.backend != "auto":
        return cfg.run.backend
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def optimizer_of(cfg: Config) -> str:
    t = cfg.train
    return "adamw" if t.optimizer == "adamw" else "sgd-momentum" if t.momentum > 0 else "sgd"


def precision_of(cfg: Config) -> Precision:
    """What dtlab's strategies hold: fp32 state; bf16/fp16 only in compute (and reductions,
    with strategy.fsdp[1].reduce_fp32=false)."""
    p = cfg.train.precision
    if p == "fp32":
        return PRECISIONS["fp32"]
    if cfg.strategy.name == "deepspeed":  # 16-bit working weights, fp32 master (ZeRO paper's)
        return PRECISIONS[p]
    prec = PRECISIONS[f"{p}-autocast"]
    options = {"fsdp": cfg.strategy.fsdp, "fsdp1": cfg.strategy.fsdp1}.get(cfg.strategy.name)
    return replace(prec, reduce=2) if options is not None and not options.reduce_fp32 else prec


def plan_of(cfg: Config, label: str, ranks_per_node: int) -> Plan | None:
    """The ideal layout (memory.KINDS) a dtlab strategy corresponds to, for its temporaries and
    communication; None for tensor and pipeline parallelism, which no layout here describes."""
    s = cfg.strategy
    kind = {"single": "ddp", "ddp": "ddp", "zero1": "zero1",
            "fsdp": "zero3" if s.fsdp.reshard_after_forward else "zero2"}.get(s.name)
    offload, group = s.name == "fsdp" and s.fsdp.cpu_offload, None
    if s.name == "fsdp1":
        o = s.fsdp1
        kind = {"SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp"}.get(o.sharding_strategy, "zero3")
        offload = o.cpu_offload
        if o.sharding_strategy == "HYBRID_SHARD":
            group = o.shard_group_size or ranks_per_node
    if s.name == "deepspeed":
        from dtlab.estimate.deepspeed_layout import zero_stage

        kind = f"zero{zero_stage(cfg)}"
    return Plan(kind, offload, group, label) if kind else None


def exact_state(cfg: Config, world: int, ranks_per_node: int,
                device: str = "cpu") -> list[RankBytes]:
    """Per-rank param/grad/optim bytes of `cfg`'s strategy on `world` ranks: measured under the
    fake backend (measured.py: every rank up to 16, else the ranks holding the most), or for
    DeepSpeed modelled for every rank (deepspeed_layout.py)."""
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
    if not precision.mixed:
        return "fp32"
    return "half" if precision.master or wrapper_casts else "autocast"


def strategy_config(setup: Setup, token: str) -> Config | None:
    """The config of a dtlab strategy spec (fsdp1:SHARD_GRAD_OP...) on the setup's model; None
    for the ideal layouts (zero2, hybrid:4...) or a model given by its parameter count."""
    from dtlab.compare import parse_spec
    from dtlab.config import load_config
    from dtlab.errors import ConfigError

    if setup.model.cfg is None:
        return None
    try:
        spec_overrides = parse_spec(token)
    except ConfigError:
        return None
    path, overrides = setup.model.source
    return load_config(path, [*overrides, *spec_overrides])


def estimate(setup: Setup, token: str) -> dict[str, Any]:
    """One row: the bytes per rank of `token`'s strategy (see memory.parse_plan, or a dtlab
    strategy spec like fsdp1:SHARD_GRAD_OP when the model comes from a config)."""
    import torch

    m, world = setup.model, setup.world
    cfg = strategy_config(setup, token)
    per_rank, source, notes = None, IDEAL, []
    if cfg is not None:
        plan = plan_of(cfg, token, setup.ranks_per_node)
        device = "cuda" if setup.backend == "nccl" and torch.cuda.is_available() else "cpu"
        try:
            per_rank = exact_state(cfg, world, setup.ranks_per_node, device)
            source = DEEPSPEED if cfg.strategy.name == "deepspeed" else MEASURED
        except NotMeasured as e:
            if plan is None:
                raise
            notes.append(f"{token}: not measured ({e}); the ideal {plan.kind} layout instead")
        precision = precision_of(cfg)
    if per_rank is None:
        plan = plan if cfg is not None else memory.parse_plan(token, world, setup.ranks_per_node)
        precision = precision_of(cfg) if cfg is not None else setup.precision
        state = memory.state_per_rank(m.n_params, plan, precision, setup.optimizer, world)
        held: dict[str, int] = {}
    else:
        held = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "rank"}
        master = held.get("master_bytes", 0)  # DeepSpeed: inside optim_bytes, shown apart
        state = memory.State(held["param_bytes"], held["grad_bytes"], master,
                             held["optim_bytes"] - master, 0.0)
        if "host_bytes" in held:  # DeepSpeed: what its offload puts in host memory
            state = replace(state, offloaded=held["host_bytes"])
            plan = replace(plan, offload=plan.offload or held["host_bytes"] > 0)
        elif plan is not None and plan.offload:
            state = replace(state, offloaded=state.total)  # FSDP offloads all of its shards
    row: dict[str, Any] = {
        "strategy": token, "layout": plan.kind + ("+offload" if plan.offload else "")
        if plan else cfg.strategy.name, "shards": plan.shards(world) if plan else None,
        "exact": per_rank is not None, "source": source,
        "params": state.params, "grads": state.grads, "master": state.master,
        "optimizer": state.optimizer, "state": state.total, "host": state.offloaded,
    }
    if per_rank is not None:
        row["per_rank"] = per_rank
    if plan is None:  # tp, fsdp_tp, pp: the state is measured, the rest not modelled
        notes.append(f"{token}: temporaries, activations and communication of tensor and "
                     "pipeline parallelism are not modelled (shown as 0 and -)")
        row.update(temporaries={}, device_total=state.device, comm=None, notes=notes)
        return row
    row["temporaries"] = temporaries(setup, plan, precision, cfg, held)
    row["host"] += held.get("host_buffer_bytes", 0)
    act = None
    if m.segments is not None:
        from dtlab.strategies import strategy_class

        casts = plan.kind == "zero3" if cfg is None else strategy_class(cfg.strategy.name).wrapper_casts
        mode = activation_mode(precision, casts)
        act = activations.walk(m.segments(setup.micro, mode), setup.checkpointing)
        row["activations"] = {"saved": act.saved, "peak": act.peak, "mode": mode}
    row["device_total"] = state.device + sum(row["temporaries"].values()) + (act.peak if act else 0.0)
    name = cfg.strategy.name if cfg is not None else None
    calls = comm.collectives(plan, m.units, precision, world, setup.ranks_per_node,
                             name is None or plan.kind != "zero2", name == "zero1", setup.backend,
                             m.root, name != "fsdp1")
    row["comm"] = comm.summarize(calls, setup.links)
    row["comm"]["host_device_bytes"] = comm.offload_bytes(plan, m.n_params, precision, world)
    if notes:
        row["notes"] = notes
    return row


def temporaries(setup: Setup, plan: Plan, precision: Precision, cfg: Config | None,
                held: dict[str, int]) -> dict[str, float]:
    """memory.temporaries, with DeepSpeed's own buckets and staging buffers where modelled."""
    m, deepspeed = setup.model, cfg is not None and cfg.strategy.name == "deepspeed"
    temps = memory.temporaries(m.n_params, max(m.units, default=0.0), m.root, plan, precision,
                               setup.world, gathers_all=cfg is not None and plan.kind == "zero2"
                               and not deepspeed)
    if deepspeed and held:  # allocated whatever the model size
        temps["buffers"] = held["buffer_bytes"] - held["host_buffer_bytes"]
        temps["backward_buckets"] = held["backward_buffer_bytes"]
    return temps


def describe(setup: Setup) -> str:
    p = setup.precision
    return (f"{setup.model.name}, {setup.world} ranks ({setup.ranks_per_node} per node), "
            f"{setup.optimizer} ({OPTIMIZER_BYTES[setup.optimizer]} B/param of state), "
            f"{p.name} (weights {p.weight} B, grads {p.grad} B, master {p.master} B), "
            f"micro batch {setup.micro}, {setup.backend}, activation checkpointing "
            f"{'on' if setup.checkpointing else 'off'}")
