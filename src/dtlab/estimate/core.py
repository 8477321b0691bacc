"""One estimate: a model, a world, a precision and optimizer, a strategy -> the numbers per rank.

A model comes from a dtlab config (built on the meta device: exact parameter shapes, and for
dtlab's own strategies the exact sharded layouts of layout.py) or from a parameter count, with a
GPT shape for activations and sharding units: given (--n-layer, --hidden) or by the rule
hidden = 128 x n_layer, n_layer = floor((P / (12 x 128^2))^(1/3)) (P ~ 12 n_layer hidden^2, the
shapes of LLaMA-7B, 32 x 4096, and GPT-3 175B, 96 x 12288).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtlab.config import Config
from dtlab.estimate import activations, comm, layout, memory
from dtlab.estimate.memory import OPTIMIZER_BYTES, PRECISIONS, Plan, Precision


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
    meta = layout.meta_model(cfg)
    units = [float(sum(t.numel for t in u)) for u in layout.fsdp2_units(meta, root=False)]
    n = float(sum(t.numel for t in layout.as_tensors(layout.unique_params(meta))))

    def segments(micro: int, mode: str) -> list[activations.Segment]:
        return activations.config_segments(cfg, micro, mode)

    return Model(f"{cfg.model.name} ({int(n):,} parameters)", n, units, n - sum(units), segments,
                 cfg, (path, list(overrides)))


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
    s = cfg.strategy
    options = {"fsdp": s.fsdp, "fsdp1": s.fsdp1}.get(s.name)
    if options is not None and not options.reduce_fp32:
        prec = replace(prec, reduce=2)
    return prec


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


def estimate(setup: Setup, token: str) -> dict[str, Any]:
    """One row: the bytes per rank of `token`'s strategy (see memory.parse_plan, or a dtlab
    strategy spec like fsdp1:SHARD_GRAD_OP when the model comes from a config)."""
    m, world = setup.model, setup.world
    exact = exact_strategy(setup, token)
    if exact is not None:
        plan, cfg, per_rank, reshard, wrapper_casts = exact
        precision = precision_of(cfg)
        held = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        master = held.get("master_bytes", 0)  # DeepSpeed: inside optim_bytes, shown apart
        state = memory.State(held["param_bytes"], held["grad_bytes"], master,
                             held["optim_bytes"] - master, 0.0)
        if "host_bytes" in held:  # DeepSpeed: what its offload puts in host memory
            state = replace(state, offloaded=held["host_bytes"])
        elif plan.offload:
            state = replace(state, offloaded=state.total)  # FSDP offloads all of its shards
        torch_zero1 = cfg.strategy.name == "zero1"
    else:
        plan = memory.parse_plan(token, world, setup.ranks_per_node)
        precision, per_rank, reshard, torch_zero1 = setup.precision, None, True, False
        wrapper_casts = plan.kind == "zero3"
        state = memory.state_per_rank(m.n_params, plan, precision, setup.optimizer, world)
    deepspeed = exact is not None and exact[1].strategy.name == "deepspeed"
    temps = memory.temporaries(m.n_params, max(m.units, default=0.0), m.root, plan, precision, world,
                               gathers_all=exact is not None and plan.kind == "zero2"
                               and not deepspeed)
    host_buffers = 0.0
    if deepspeed:  # its buckets and staging buffers, allocated whatever the model size
        temps["buffers"] = held["buffer_bytes"] - held["host_buffer_bytes"]
        temps["backward_buckets"] = held["backward_buffer_bytes"]
        host_buffers = held["host_buffer_bytes"]
    row: dict[str, Any] = {
        "strategy": token, "layout": plan.kind + ("+offload" if plan.offload else ""),
        "shards": plan.shards(world), "exact": exact is not None,
        "params": state.params, "grads": state.grads, "master": state.master,
        "optimizer": state.optimizer, "state": state.total,
        "host": state.offloaded + host_buffers,
        "temporaries": temps,
    }
    if per_rank is not None:
        row["per_rank"] = per_rank
    act = None
    if m.segments is not None:
        mode = activation_mode(precision, wrapper_casts)
        act = activations.walk(m.segments(setup.micro, mode), setup.checkpointing)
        row["activations"] = {"saved": act.saved, "peak": act.peak, "mode": mode}
    row["device_total"] = state.device + sum(temps.values()) + (act.peak if act else 0.0)
    root_reshards = not (exact is not None and exact[1].strategy.name == "fsdp1")
    calls = comm.collectives(plan, m.units, precision, world, setup.ranks_per_node, reshard,
                             torch_zero1, setup.backend, m.root, root_reshards)
    row["comm"] = comm.summarize(calls, setup.links)
    row["comm"]["host_device_bytes"] = comm.offload_bytes(plan, m.n_params, precision, world)
    return row


def exact_strategy(setup: Setup, token: str) -> tuple[Plan, Config, list, bool, bool] | None:
    """For a config's model and a dtlab strategy spec: its plan, config, exact per-rank bytes,
    whether it re-gathers for backward, and whether the wrapper casts (no autocast)."""
    if setup.model.cfg is None:
        return None
    from dtlab.compare import parse_spec
    from dtlab.config import load_config
    from dtlab.errors import ConfigError
    from dtlab.strategies.registry import strategy_class

    try:
        spec_overrides = parse_spec(token)
    except ConfigError:
        return None  # not a dtlab strategy: the ideal layouts apply
    path, overrides = setup.model.source
    cfg = load_config(path, [*overrides, *spec_overrides])
    s = cfg.strategy
    kind = layout.layout_kind(cfg)
    group = None
    if s.name == "fsdp1" and s.fsdp1.sharding_strategy == "HYBRID_SHARD":
        group = s.fsdp1.shard_group_size or setup.ranks_per_node
    offload = (s.name == "fsdp" and s.fsdp.cpu_offload) or (s.name == "fsdp1" and s.fsdp1.cpu_offload)
    reshard = kind != "zero2"
    device = "cuda" if setup.backend == "nccl" else "cpu"
    per_rank = layout.exact_state(cfg, setup.world, setup.ranks_per_node, device)
    offload = offload or any(r.get("host_bytes") for r in per_rank)  # DeepSpeed's offload
    plan = Plan(kind, offload, group, token)
    return plan, cfg, per_rank, reshard, strategy_class(s.name).wrapper_casts


def describe(setup: Setup) -> str:
    p = setup.precision
    return (f"{setup.model.name}, {setup.world} ranks ({setup.ranks_per_node} per node), "
            f"{setup.optimizer} ({OPTIMIZER_BYTES[setup.optimizer]} B/param of state), "
            f"{p.name} (weights {p.weight} B, grads {p.grad} B, master {p.master} B), "
            f"micro batch {setup.micro}, {setup.backend}, activation checkpointing "
            f"{'on' if setup.checkpointing else 'off'}")
