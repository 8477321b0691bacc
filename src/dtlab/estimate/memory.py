"""Per-rank training state of data parallelism, by arithmetic (the ZeRO paper's accounting).

Per parameter, with n the ranks that share (shard) the state:

    weights     w bytes    fp32: 4; bf16/fp16 mixed precision: 2
    gradients   g bytes    the weights' dtype
    master      m bytes    an fp32 copy of the weights, kept beside the optimizer when the weights
                           are 16-bit (4), else none; it is sharded with the optimizer state
    optimizer   k bytes    fp32 states: SGD 0, SGD with momentum 4, Adam/AdamW 8 (two moments)

    strategy                     weights   gradients   master + optimizer
    ddp (and FSDP NO_SHARD)      w         g           m + k
    zero1                        w         g           (m + k) / n
    zero2 (~ SHARD_GRAD_OP)      w         g / n       (m + k) / n
    zero3 (FSDP FULL_SHARD)      w / n     g / n       (m + k) / n
    hybrid:s (HYBRID_SHARD)      as zero3 with n = s, the ranks of one shard group
    +offload                     the sharded terms live in host memory instead of on the device

The textbook case: 7e9 parameters, AdamW, fp32, 4 ranks: ddp holds 28 + 28 + 56 = 112 GB per
rank, zero3 a quarter of it, 28 GB. bf16 mixed precision holds 2 + 2 + (4 + 8) = 16 bytes per
parameter (the ZeRO paper's K = 12 for the master weights and Adam's moments).

`bf16-autocast` (and fp16-autocast) is what torch autocast and FSDP's MixedPrecisionPolicy do, and
what dtlab's strategies do with train.precision=bf16: weights, gradients and optimizer state stay
fp32; only activations, all-gathered parameters and (optionally) reductions are 16-bit.

FSDP's SHARD_GRAD_OP shards the weights between steps, but gathers every unit's weights in forward
and keeps them until its backward: at the peak it holds them all, as DeepSpeed's ZeRO-2 does all
the time. zero2 here is the ZeRO-2 layout; the exact FSDP layouts are in `layout.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

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

KINDS = ("ddp", "zero1", "zero2", "zero3")
ALIASES = {
    "single": "ddp", "ddp": "ddp", "no_shard": "ddp",
    "zero1": "zero1",
    "zero2": "zero2", "shard_grad_op": "zero2",
    "zero3": "zero3", "fsdp": "zero3", "full_shard": "zero3",
    "hybrid": "zero3", "hybrid_shard": "zero3", "hsdp": "zero3",
}


@dataclass(frozen=True)
class Plan:
    """A data-parallel layout: which state is divided, over how many ranks, and where it lives."""

    kind: str  # ddp | zero1 | zero2 | zero3
    offload: bool = False
    shard_group: int | None = None  # hybrid: ranks per shard group (replicated across groups)
    label: str = ""

    def shards(self, world: int) -> int:
        return self.shard_group or world


def parse_plan(token: str, world: int, ranks_per_node: int | None = None) -> Plan:
    """`zero3`, `zero2+offload`, `hybrid:8`, `FULL_SHARD`, `fsdp+offload`... -> a Plan."""
    text = token.strip()
    base, _, suffix = text.partition("+")
    name, _, arg = base.partition(":")
    kind = ALIASES.get(name.lower())
    if kind is None or suffix not in ("", "offload"):
        raise DtlabError(
            f"--strategies: '{token}' is not a strategy; fix: use ddp, zero1, zero2, zero3 "
            "(or fsdp, FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), hybrid:S, with +offload for zero1/2/3"
        )
    group = None
    if name.lower() in ("hybrid", "hybrid_shard", "hsdp"):
        try:
            group = int(arg) if arg else (ranks_per_node or world)
        except ValueError:
            group = 0
        if group < 1 or world % group:
            raise DtlabError(
                f"--strategies: '{token}': a shard group of {arg or group} ranks does not divide "
                f"{world} ranks; fix: write hybrid:S with S a divisor of the world size"
            )
    elif arg:
        raise DtlabError(f"--strategies: '{token}': only hybrid takes ':S'; fix: remove ':{arg}'")
    if suffix == "offload" and kind == "ddp":
        raise DtlabError(
            f"--strategies: '{token}': a full replica has nothing sharded to offload; "
            "fix: use zero1+offload, zero2+offload or zero3+offload"
        )
    return Plan(kind, suffix == "offload", group, text)


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
    def device(self) -> float:
        return self.total - self.offloaded


def state_per_rank(n_params: float, plan: Plan, precision: Precision, optimizer: str,
                   world: int) -> State:
    """The ideal per-rank bytes: every sharded term divided exactly by the shard count."""
    n = plan.shards(world)
    sharded = {"ddp": (), "zero1": ("master", "optimizer"),
               "zero2": ("grads", "master", "optimizer"),
               "zero3": ("params", "grads", "master", "optimizer")}[plan.kind]
    full = {"params": n_params * precision.weight, "grads": n_params * precision.grad,
            "master": n_params * precision.master,
            "optimizer": n_params * OPTIMIZER_BYTES[optimizer]}
    held = {k: v / n if k in sharded else v for k, v in full.items()}
    offloaded = sum(held[k] for k in sharded) if plan.offload else 0.0
    return State(held["params"], held["grads"], held["master"], held["optimizer"], offloaded)


def temporaries(n_params: float, largest_unit: float, root: float, plan: Plan,
                precision: Precision, world: int, gathers_all: bool = False) -> dict[str, float]:
    """Device bytes that exist only during a step, beside the state and the activations.

    zero3: the all-gathered weights of the root unit (embeddings and head: gathered for the whole
    forward and backward), of the block being computed and of the next one (prefetched), and one
    unit's unsharded gradients before their reduce-scatter. zero2: one unit's unsharded
    gradients; with `gathers_all` (FSDP's SHARD_GRAD_OP, whose weights are sharded between steps)
    also every unit's gathered weights, held from forward to backward. (autocast's 16-bit copies
    of the weights are saved tensors: activations.py counts them.)
    """
    if plan.shards(world) == 1:
        return {}
    if plan.kind == "zero3":
        return {"gathered_params": (root + 2 * largest_unit) * precision.compute,
                "unsharded_grads": max(largest_unit, root) * precision.reduce}
    if plan.kind == "zero2":
        out = {"unsharded_grads": max(largest_unit, root) * precision.reduce}
        if gathers_all:
            out["gathered_params"] = n_params * precision.compute
        return out
    return {}
