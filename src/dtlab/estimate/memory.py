"""Per-rank training state of data parallelism, by arithmetic (the ZeRO paper's accounting).

Per parameter, weights w, gradients g, fp32 master m (16-bit weights only), optimizer k bytes;
n = the ranks that shard: ddp holds w + g + m + k, zero1 w + g + (m + k)/n, zero2 w + (g + m +
k)/n, zero3 (w + g + m + k)/n, hybrid:s zero3 with n = s, +offload moves the sharded terms to
the host. 7e9 parameters, AdamW, fp32, 4 ranks: ddp 112 GB per rank, zero3 28 GB. The tables and
why: docs/memory.md. `*-autocast` is what dtlab's strategies do with train.precision=bf16: fp32
state, 16-bit compute (activations, gathered parameters, optionally reductions).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dtlab.config.strategies import registry
from dtlab.errors import DtlabError


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor."""

    name: str
    weight: int  # stored parameters
    grad: int  # stored gradients
    master: int  # fp32 master copy (0: the weights are the master)
    compute: int  # activations, all-gathered parameters
    reduce: int  # gradients as they are reduced

    @property
    def mixed(self) -> bool:
        return self.compute < 4


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 0, 4, 4),
    "bf16": Precision("bf16", 2, 2, 4, 2, 2),
    "fp16": Precision("fp16", 2, 2, 4, 2, 2),
    "bf16-autocast": Precision("bf16-autocast", 4, 4, 0, 2, 4),
    "fp16-autocast": Precision("fp16-autocast", 4, 4, 0, 2, 4),
}

# fp32 optimizer-state bytes per parameter.
OPTIMIZER_BYTES = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8}

class Kind(StrEnum):
    """The ideal layouts, by what they shard (named as `--strategies` takes them)."""

    REPLICATED = "ddp"
    ZERO1 = "zero1"  # optimizer state (and fp32 master weights)
    ZERO2 = "zero2"  # + gradients
    ZERO3 = "zero3"  # + parameters


HYBRID = ("hybrid", "hybrid_shard", *(n for n, s in registry.SPECS.items() if s.shard_group))
ALIASES = {**{k.value: k for k in Kind}, "no_shard": Kind.REPLICATED, "shard_grad_op": Kind.ZERO2,
           "full_shard": Kind.ZERO3, **dict.fromkeys(HYBRID, Kind.ZERO3),
           **{n: Kind(s.textbook) for n, s in registry.SPECS.items() if s.textbook}}


@dataclass(frozen=True)
class Plan:
    """A data-parallel layout: which state is divided, over how many ranks, and where it lives."""

    kind: str  # a Kind
    offload: bool = False
    shard_group: int | None = None  # hybrid: ranks per shard group (replicated across groups)

    def shards(self, world: int) -> int:
        return self.shard_group or world


def parse_plan(token: str, world: int, ranks_per_node: int | None = None) -> Plan:
    """`zero3`, `zero2+offload`, `hybrid:8`, `FULL_SHARD`, `fsdp+offload`... -> a Plan."""
    base, _, suffix = token.strip().partition("+")
    name, _, arg = base.lower().partition(":")
    kind, bad = ALIASES.get(name), f"--strategies: '{token}'"
    if kind is None or suffix not in ("", "offload"):
        raise DtlabError(f"{bad} is not a strategy; fix: use ddp, zero1, zero2, zero3 (or fsdp, "
                         "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), hybrid:S, with +offload for zero1/2/3")
    group = None
    if name in HYBRID:
        if ":" in base and not arg.isdigit():  # hybrid:, hybrid:abc, hybrid:-2, hybrid:1.5
            raise DtlabError(f"{bad}: S in hybrid:S is ranks per shard group, a whole number; "
                             f"fix: e.g. hybrid:{ranks_per_node or world}, or plain hybrid for "
                             "the ranks of one node")
        group = int(arg) if arg else ranks_per_node or world
        if group < 1 or world % group:
            raise DtlabError(f"{bad}: a shard group of {group} ranks does not divide {world} "
                             "ranks; fix: write hybrid:S with S a divisor of the world size")
    elif arg:
        raise DtlabError(f"{bad}: only hybrid takes ':S'; fix: remove ':{arg}'")
    if suffix == "offload" and kind == Kind.REPLICATED:
        raise DtlabError(f"{bad}: a full replica has nothing sharded to offload; fix: use "
                         "zero1+offload, zero2+offload or zero3+offload")
    return Plan(kind, suffix == "offload", group)


@dataclass(frozen=True)
class State:
    """Bytes per rank of the training state (what persists from step to step)."""

    params: float
    grads: float
    master: float
    optimizer: float
    offloaded: float  # the part of the above held in host memory

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def device(self) -> float:  # what stays on the device
        return self.total - self.offloaded


def state_per_rank(n_params: float, plan: Plan, precision: Precision, optimizer: str,
                   world: int) -> State:
    """The ideal per-rank bytes: every sharded term divided exactly by the shard count."""
    n = plan.shards(world)
    sharded = {Kind.REPLICATED: (), Kind.ZERO1: ("master", "optimizer"),
               Kind.ZERO2: ("grads", "master", "optimizer"),
               Kind.ZERO3: ("params", "grads", "master", "optimizer")}[plan.kind]
    full = {"params": n_params * precision.weight, "grads": n_params * precision.grad,
            "master": n_params * precision.master, "optimizer": n_params * OPTIMIZER_BYTES[optimizer]}
    held = {k: v / n if k in sharded else v for k, v in full.items()}
    offloaded = sum(held[k] for k in sharded) if plan.offload else 0.0
    return State(held["params"], held["grads"], held["master"], held["optimizer"], offloaded)


def temporaries(n_params: float, largest_unit: float, root: float, plan: Plan,
                precision: Precision, world: int, gathers_all: bool = False) -> dict[str, float]:
    """Device bytes that exist only during a step, beside the state and the activations. zero3:
    the gathered weights of the root unit (kept through the step), of the block computed and of
    the next (prefetched), and one unit's unsharded gradients; zero2: those gradients, and with
    `gathers_all` (FSDP's SHARD_GRAD_OP) every unit's weights, held from forward to backward.
    (autocast's 16-bit copies of the weights are saved tensors: activations.py counts them.)"""
    grads = {"unsharded_grads": max(largest_unit, root) * precision.reduce}
    if plan.shards(world) == 1 or plan.kind not in (Kind.ZERO2, Kind.ZERO3):
        return {}
    if plan.kind == Kind.ZERO3:
        return {"gathered_params": (root + 2 * largest_unit) * precision.compute, **grads}
    return {**grads, **({"gathered_params": n_params * precision.compute} if gathers_all else {})}
