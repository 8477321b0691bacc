"""One estimate: a model, a world, a precision and optimizer, a strategy -> the numbers per rank.

A model comes from a dtlab config (the state of dtlab's strategies is then measured under the
fake backend, measure.py, or for DeepSpeed modelled, strategies/deepspeed_memory.py) or from a parameter
count, with a GPT shape for activations and sharding units: given, or by the rule hidden = 128 x
n_layer, n_layer = floor((P / (12 x 128^2))^(1/3)) (the shapes of LLaMA-7B and GPT-3 175B).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dtlab.config import Config
from dtlab.config.strategies import registry
from dtlab.errors import DtlabError
from dtlab.estimate import activations, comm, memory
from dtlab.estimate.measure import MAX_WORLD, NotMeasured, RankBytes, measure, meta_model
from dtlab.estimate.memory import OPTIMIZER_BYTES, PRECISIONS, Kind, Plan, Precision
from dtlab.models import count_params
from dtlab.strategies import strategy_class

MEASURED, IDEAL = "measured (fake backend)", "modelled (ideal layout)"  # sources of state bytes


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


def model_from_size(n_params: float, n_layer: int | None, hidden: int | None,
                    n_head: int | None, seq_len: int | None, vocab: int) -> Model:
    notes = []
    if n_layer is None or hidden is None:
        n_layer = n_layer or max(1, math.floor((n_params / (12 * 128 * 128)) ** (1 / 3)))
        hidden = hidden or 128 * n_layer
        notes.append(f"shape by the hidden = 128 x layers rule: {n_layer} layers x {hidden}")
    heads = n_head or max(1, hidden // 128)
    if n_head and hidden % n_head:
        raise DtlabError(f"--n-head {n_head} does not divide the hidden size {hidden} (each head "
                         f"takes hidden / heads dimensions); fix: a number of heads that divides "
                         f"{hidden}, or another --hidden")
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
    n = float(count_params(model))
    segments = None if cfg.model.name == "hf" else (  # transformers' blocks are not modelled
        lambda micro, mode: activations.config_segments(cfg, micro, mode))
    return Model(f"{cfg.model.name} ({int(n):,} parameters)", n, [u for u in units if u],
                 n - sum(units), segments, cfg, (path, list(overrides)), [] if segments else
                 ["activations of model.name=hf are not modelled: state only (dtlab train)"])


def optimizer_of(cfg: Config) -> str:
    t = cfg.train
    return "adamw" if t.optimizer == "adamw" else "sgd-momentum" if t.momentum > 0 else "sgd"


def precision_of(cfg: Config) -> Precision:
    """What dtlab's strategies hold: fp32 state; bf16/fp16 only in compute (and reductions, with
    reduce_fp32=false). Master-weight training (DeepSpeed): 16-bit weights, fp32 master."""
    p, spec = cfg.train.precision, registry.of(cfg)
    if p == "fp32" or spec.master_weights:
        return PRECISIONS[p]
    low_reduce = getattr(getattr(cfg.strategy, spec.name, None), "reduce_fp32", True) is False
    return replace(PRECISIONS[f"{p}-autocast"], **({"reduce": 2} if low_reduce else {}))


def plan_of(cfg: Config, ranks_per_node: int) -> Plan | None:
    """The ideal layout a dtlab strategy corresponds to, for its temporaries and communication;
    None for tensor and pipeline parallelism, which no layout here describes."""
    spec = registry.of(cfg)
    if spec.model_parallel is not None:
        return None
    offload = bool(getattr(getattr(cfg.strategy, spec.name, None), "cpu_offload", False))
    group = spec.shard_group(cfg, ranks_per_node) if spec.shard_group else None
    return Plan(spec.layout(cfg) if spec.layout else Kind.REPLICATED, offload, group)


def exact_state(cfg: Config, world: int, ranks_per_node: int,
                device: str = "cpu") -> tuple[list[RankBytes], str]:
    """Per-rank param/grad/optim bytes of `cfg`'s strategy on `world` ranks, and their source:
    measured under the fake backend (every rank up to 16, else the ranks holding the most), or
    the strategy's model where its library cannot run there (DeepSpeed). Both list every rank:
    beyond MAX_WORLD ranks, NotMeasured (the ideal layout stands in)."""
    if world > MAX_WORLD:
        raise NotMeasured(f"{world:,} ranks, more than the {MAX_WORLD:,} measured in seconds")
    model = registry.of(cfg).memory_model
    if model is None:
        return measure(cfg, world, ranks_per_node, device), MEASURED
    module = importlib.import_module(f"dtlab.strategies.{model}")
    return module.modelled_state([p.numel() for p in meta_model(cfg).parameters()], cfg, world,
                                 device), module.SOURCE


@dataclass
class Setup:
    model: Model
    world: int
    ranks_per_node: int
    precision: Precision
    optimizer: str
    micro: int = 1
    checkpointing: bool | tuple[int, ...] = False  # every block, none, or these blocks
    links: comm.Links | None = None
    backend: str = "nccl"  # gloo runs reduce-scatter as an all-reduce (comm.collectives)


def activation_mode(precision: Precision, wrapper_casts: bool) -> str:
    """fp32; half when the weights are 16-bit in compute (master weights, 16-bit gathers); else
    autocast."""
    return "fp32" if not precision.mixed else "half" if precision.master or wrapper_casts else "autocast"


def strategy_config(setup: Setup, token: str) -> Config | None:
    """The config of a dtlab strategy spec (fsdp1:SHARD_GRAD_OP...) on the setup's model; None
    for the ideal layouts (zero2, hybrid:4...) or a model given by its parameter count. A token
    that is neither, or a dtlab spec that is invalid or made for another world size, is refused."""
    from dtlab.config import load_config
    from dtlab.config.strategies.registry import parse as parse_spec
    from dtlab.errors import ConfigError

    name = token.partition(":")[0].partition("@")[0].partition("+")[0]
    if setup.model.cfg is None or (name not in registry.SPECS and name.lower() in memory.ALIASES):
        return None
    if name not in registry.SPECS:
        raise ConfigError(f"--strategies: '{token}' is neither a dtlab strategy nor a layout; "
                          f"fix: use {', '.join(registry.NAMES)} (with --config), or ddp, zero1, "
                          "zero2, zero3, hybrid:S, with +offload for zero1/2/3")
    path, overrides = setup.model.source
    try:
        cfg = load_config(path, [*overrides, *parse_spec(token)])
    except ConfigError as e:  # a dtlab strategy spelt wrong (fsdp1:FOO) is that, not a layout
        text = str(e)
        raise ConfigError(text if text.startswith("--strategies") else
                          f"--strategies '{token}': {text}") from None
    return cfg


def estimate(setup: Setup, token: str) -> dict[str, Any]:
    """One row: the bytes per rank of `token`'s strategy (see memory.parse_plan, or a dtlab
    strategy spec like fsdp1:SHARD_GRAD_OP when the model comes from a config)."""
    import torch

    m, world, rpn = setup.model, setup.world, setup.ranks_per_node
    cfg = strategy_config(setup, token)
    spec = cfg and registry.of(cfg)
    plan = memory.parse_plan(token, world, rpn) if cfg is None else plan_of(cfg, rpn)
    precision = setup.precision if cfg is None else precision_of(cfg)
    per_rank, source, notes, held = None, IDEAL, [], {}
    if cfg is not None:
        device = "cuda" if setup.backend == "nccl" and torch.cuda.is_available() else "cpu"
        try:
            per_rank, source = exact_state(cfg, world, rpn, device)
        except NotMeasured as e:
            if plan is None and "; fix:" in str(e):  # refused by the strategy's own checks
                raise DtlabError(f"--strategies '{token}' on {world} ranks: {e}") from None
            if plan is None:  # tp, pp: no ideal layout to stand in
                raise DtlabError(f"--strategies '{token}': not measured ({e}) and no layout "
                                 "models tensor or pipeline parallelism; fix: a smaller "
                                 "--world-size or model, or a data-parallel strategy") from None
            notes.append(f"{token}: not measured ({e}); the ideal {plan.kind} layout instead")
    if per_rank is None:
        state = memory.state_per_rank(m.n_params, plan, precision, setup.optimizer, world)
    else:
        held = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "rank"}
        master = held.get("master_bytes", 0)  # DeepSpeed: inside optim_bytes, shown apart
        state = memory.State(held["param_bytes"], held["grad_bytes"], master,
                             held["optim_bytes"] - master, 0.0)
        if "host_bytes" in held:  # DeepSpeed: what its offload keeps in host memory (or on disk)
            state = replace(state, offloaded=held["host_bytes"] + held.get("swapped_bytes", 0))
            plan = replace(plan, offload=plan.offload or held["host_bytes"] > 0)
        elif plan is not None and plan.offload:
            state = replace(state, offloaded=state.total)  # FSDP offloads all of its shards
    row: dict[str, Any] = {
        "strategy": token, "layout": plan.kind + "+offload" * plan.offload if plan else spec.name,
        "shards": plan and plan.shards(world), "exact": per_rank is not None, "source": source,
        "params": state.params, "grads": state.grads, "master": state.master,
        "optimizer": state.optimizer, "state": state.total,
        "host": state.offloaded - held.get("swapped_bytes", 0) + held.get("host_buffer_bytes", 0),
        **({"disk": held["disk_bytes"]} if "disk_bytes" in held else {}),  # NVMe offload's files
        **({"per_rank": per_rank} if per_rank else {}), "temporaries": {}, "comm": None}
    if plan is None:  # tp, fsdp_tp, pp, cp: the state is measured, the rest not modelled
        notes.append(f"{token}: temporaries, activations and communication of tensor, "
                     "pipeline and context parallelism are not modelled (shown as 0 and -)")
        return {**row, "device_total": state.device, "notes": notes}
    temps = row["temporaries"] = memory.temporaries(
        m.n_params, max(m.units, default=0.0), m.root, plan, precision, world,
        gathers_all=plan.kind == Kind.ZERO2 and bool(spec and spec.shards_state))
    if "buffer_bytes" in held:  # DeepSpeed's buckets and staging buffers, whatever the model size
        temps.update(buffers=held["buffer_bytes"] - held["host_buffer_bytes"],
                     backward_buckets=held["backward_buffer_bytes"])
    act = None
    if m.segments is not None:
        casts = (plan.kind == Kind.ZERO3 if spec is None
                 else strategy_class(spec.name).wrapper_casts)
        mode = activation_mode(precision, casts)
        act = activations.walk(m.segments(setup.micro, mode), setup.checkpointing)
        row["activations"] = {"saved": act.saved, "peak": act.peak, "mode": mode}
    row["device_total"] = state.device + sum(temps.values()) + (act.peak if act else 0.0)
    calls = comm.collectives(plan, m.units, precision, world, rpn, spec is None or
                             plan.kind != Kind.ZERO2, bool(spec and spec.broadcasts_updates),
                             setup.backend, m.root, not (spec and spec.root_stays_gathered))
    row["comm"] = {**comm.summarize(calls, setup.links),
                   "host_device_bytes": comm.offload_bytes(plan, m.n_params, precision, world)}
    return {**row, "notes": notes} if notes else row


def describe(setup: Setup) -> str:
    p = setup.precision
    return (f"{setup.model.name}, {setup.world} ranks ({setup.ranks_per_node} per node), "
            f"{setup.optimizer} ({OPTIMIZER_BYTES[setup.optimizer]} B/param of state), "
            f"{p.name} (weights {p.weight} B, grads {p.grad} B, master {p.master} B), "
            f"micro batch {setup.micro}, {setup.backend}, activation checkpointing "
            + ("off" if not setup.checkpointing else "on" if setup.checkpointing is True
               else f"on blocks {', '.join(map(str, setup.checkpointing))}"))
