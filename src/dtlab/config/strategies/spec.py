"""What dtlab knows about a strategy without running it: its description, `<name>_spec.py`
(torch-free, beside its implementation `<name>.py`: see the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config
    from dtlab.config.options import Section
else:  # *_spec.py import Config from here for annotations; dtlab.config imports them (a cycle)
    Config = Any

# (the run's strategy_options, parameters, bytes per parameter element communicated, bytes per
# gradient element, ranks) -> ring bytes each rank sends per optimizer step
CommBytes = Callable[[dict[str, Any], int, int, int, int], "float | None"]


@dataclass(frozen=True)
class StrategySpec:
    name: str
    impl: str  # "module:Class" in dtlab.strategies
    about: str  # one line, for help texts
    options: type[Section] | None = None  # the section strategy.<name>.*
    # NAME:VARIANT on the command line sets this key to one of these values (what they are, for
    # the error message: "a schedule (gpipe, 1f1b)")
    variant: tuple[str, tuple[str, ...], str] | None = None
    # NAME@MP or NAME@DPxMP sets this key to MP (the second mesh dimension)
    mesh_key: str | None = None
    # The layouts this implementation runs (config/layout.py): its model-parallel dimension
    # (`parallel.<dim>`, whose degree is mesh_key), the data-parallel flavours over it, and the
    # key that names the flavour when it runs several ("none" for single: no data parallelism)
    model_dim: str | None = None
    flavours: tuple[str, ...] = ()
    flavour_key: str | None = None
    # Other model-parallel dimensions it composes with model_dim, and the key of each degree
    # (pp with tensor parallelism inside each stage: {"tp": "strategy.pp.tp"})
    more_dims: tuple[tuple[str, str], ...] = ()
    one_process: bool = False  # runs without a process group (the reference)
    extra: tuple[str, str] | None = None  # (package it needs, the pip extra that installs it)
    # Checks at load time (no world size) and before launching (with it); both raise ConfigError.
    validate: Callable[[Config], None] | None = None
    check: Callable[[Config, int, int | None], None] | None = None
    # Checks of this machine (files, compiled ops) before launching and in each worker
    environment: Callable[[Config], None] | None = None
    # Ranks that hold one copy of the model between them (1: every rank is a data-parallel replica)
    model_parallel: Callable[[Config, int], int] | None = None
    # summary.json's strategy_options -> the name results show (the `compare --strategies` spec)
    label: Callable[[dict[str, Any]], str] | None = None
    # The ideal ZeRO layout this strategy corresponds to (estimate's ddp/zero1/zero2/zero3)
    layout: Callable[[Config], str] | None = None
    textbook: str | None = None  # what `dtlab estimate --n-params` computes for this name
    # Exact bytes: measured from the real wrapper under the fake backend, or (a module of
    # dtlab.strategies with `modelled_state`) modelled where the library cannot run there
    memory_model: str | None = None
    comm_bytes: CommBytes | None = None
    shards_state: bool = False  # parameters and gradients are split over the ranks
    # Ranks of one shard group when smaller than the world (hybrid sharding), from the config
    # and the ranks per node
    shard_group: Callable[[Config, int], int] | None = None
    master_weights: bool = False  # 16-bit working weights, fp32 master copies (not autocast)
    broadcasts_updates: bool = False  # each rank broadcasts the parameters it updated (zero1)
    root_stays_gathered: bool = False  # the root unit is not resharded after forward (FSDP1)
    # The model-parallel ranks of one replica do different work (pipeline stages): `dtlab
    # predict` traces each of them, not rank 0 alone
    distinct_ranks: Callable[[Config, int], list[int]] | None = None
    # Steps a meta-device trace (`dtlab predict` without --measure) runs before the one it
    # records, where the library's first steps differ from its steady one (DeepSpeed ZeRO-3
    # records the order of its modules in its first step and prefetches on it from then on)
    trace_warmup: int = 0

    def model_parallel_size(self, cfg: Config, world_size: int) -> int:
        return self.model_parallel(cfg, world_size) if self.model_parallel else 1

    def label_of(self, options: dict[str, Any]) -> str:
        return self.label(options) if self.label else self.name


def micro_batch_of(cfg: Config, world_size: int, model_parallel_size: int = 1) -> int:
    """Samples per replica per forward when `model_parallel_size` ranks hold one copy of the
    model, or a ConfigError when the global batch does not split over the replicas. (A
    description's own check knows its model-parallel size; config/world.py asks the registry.)"""
    t = cfg.train
    dp = max(1, world_size // model_parallel_size)
    per_step = dp * t.grad_accum_steps
    if t.global_batch_size < per_step or t.global_batch_size % per_step:
        what = f"world_size({world_size})" if dp == world_size else f"data-parallel size({dp})"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
            f"{what} x train.grad_accum_steps({t.grad_accum_steps}) = {per_step}; "
            f"fix: set train.global_batch_size to a multiple of {per_step}"
        )
    return t.global_batch_size // per_step


def ring_all_reduce(g: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of g bytes over n ranks."""
    return 2 * (n - 1) / n * g


def sharded_data_parallel(p: float, g: float, n: int, gathers: int) -> float:
    """ZeRO-3/FSDP per step: `gathers` all-gathers of the parameters, a reduce-scatter of the
    gradients, each (n - 1)/n of the full size per rank."""
    return (n - 1) / n * (gathers * p + g)


def check_mesh(cfg: Config, world_size: int, degree: int, key: str,
               models: tuple[str, ...] = ("gpt",)) -> None:
    """What every model-parallel strategy needs: a model it can split (`models`: the GPT, and
    for tensor parallelism Llama-family model.name=hf, whose own checks are tp_spec.py's), a
    degree that divides the world, and none of the features these strategies do not support."""
    name, m, t = cfg.strategy.name, cfg.model, cfg.train
    if m.name not in models:
        what = "a GPT's layers" if models == ("gpt",) else \
            "the layers of a GPT or a Llama-family Hugging Face model"
        raise ConfigError(
            f"strategy.name={name} splits {what}, not model.name={m.name}; fix: use "
            f"model.name={'|'.join(models)}, or a data-parallel strategy (ddp, fsdp, fsdp1)"
        )
    if degree > world_size or world_size % degree:
        raise ConfigError(
            f"{key}={degree} does not divide world_size={world_size} into a mesh; "
            f"fix: set {key} to a divisor of {world_size} (0 = every rank)"
        )
    if getattr(m, "tie_weights", False):  # the GPT's (tp_spec.py checks hf's)
        raise ConfigError(
            f"model.tie_weights with strategy.name={name} is not supported (the embedding and "
            "the head are split differently); fix: set model.tie_weights=false"
        )
    if t.compile != "none" or t.precision == "fp16" or cfg.run.comm_breakdown:
        what = (f"train.compile={t.compile}" if t.compile != "none" else
                "train.precision=fp16" if t.precision == "fp16" else "run.comm_breakdown")
        raise ConfigError(
            f"{what} is not supported with strategy.name={name}; fix: turn it off "
            "(bf16 works for precision)"
        )
