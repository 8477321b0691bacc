"""`pp`: pipeline parallelism with torch.distributed.pipelining; options and checks
(implementation: pp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import NonNegativeInt, PositiveInt

from dtlab.config.options import Section
from dtlab.config.strategies.spec import StrategySpec, check_mesh, micro_batch_of
from dtlab.config.strategies.tp_spec import check_sizes
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

KEY = "strategy.pp.degree"
TP_KEY = "strategy.pp.tp"
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv",
                "dualpipev")
# several stages per rank: looping (stage s on rank s % degree), or V-shaped (rank r holds stages
# r and 2 x degree - 1 - r: the first and the last on rank 0)
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
# zero bubble: the backward is split into its input and weight gradients, and the weights'
# part fills the bubble (torch.distributed.pipelining's schedules of the same names)
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")


class PPOptions(Section):
    degree: NonNegativeInt = 0  # ranks per pipeline; 0 = every rank
    schedule: Literal[PP_SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    microbatches: PositiveInt = 4  # per micro batch (each rank's batch is split into these)
    stages_per_rank: NonNegativeInt = 0  # 0 = 2 for the interleaved, looped and V schedules, else 1
    # how pipeline replicas (world / degree > 1) sync; none: no replicas (world = degree)
    dp: Literal["ddp", "fsdp", "none"] = "fsdp"
    tp: PositiveInt = 1  # tensor-parallel ranks inside each stage (3-D: pp x dp x tp)

    def stages_each(self) -> int:
        return self.stages_per_rank or (2 if self.schedule in MULTI_STAGE_SCHEDULES else 1)


def degree(cfg: Config, world_size: int) -> int:
    """Ranks per pipeline (stages' ranks); 0 = every rank a tensor-parallel group leaves."""
    return cfg.strategy.pp.degree or max(1, world_size // cfg.strategy.pp.tp)


def model_parallel(cfg: Config, world_size: int) -> int:
    """Ranks holding one copy of the model: the pipeline's ranks x each stage's tensor-parallel ones."""
    return degree(cfg, world_size) * cfg.strategy.pp.tp


def stage_ranks(cfg: Config, world_size: int) -> list[int]:
    """The rank of each pipeline stage in the first replica, at tensor-parallel rank 0 (the
    others run the same program): the ranks dtlab predict traces. The mesh is (dp, pp) without
    tensor parallelism, (pp, dp, tp) with it (strategies/pp_tp.py)."""
    d = degree(cfg, world_size)
    return list(range(d)) if cfg.strategy.pp.tp == 1 else [p * (world_size // d) for p in range(d)]


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    p, m, d = cfg.strategy.pp, cfg.model, degree(cfg, world_size)
    check_mesh(cfg, world_size, d * p.tp, KEY if p.tp == 1 else f"{KEY} x strategy.pp.tp",
               models=("gpt", "hf"))
    if p.tp > 1 or m.name == "hf":  # hf: a Llama-family model with an untied head, as tp's
        check_sizes(cfg, p.tp, TP_KEY)
    if p.dp == "none" and d * p.tp != world_size:
        dims = f"pp{d}" + (f".tp{p.tp}" if p.tp > 1 else "")
        raise ConfigError(
            f"single@{dims} (strategy.pp.dp=none) runs on exactly {d * p.tp} ranks, not "
            f"{world_size}; fix: --nproc-per-node {d * p.tp}, or fsdp@{dims} (ddp@{dims}) for "
            "data parallelism over the other ranks")
    if p.tp > 1 and p.dp == "ddp":
        raise ConfigError(
            f"ddp over pipeline x tensor-parallel stages (strategy.pp.dp=ddp with "
            f"strategy.pp.tp={p.tp}) is not supported; fix: fsdp@pp{d}.tp{p.tp} "
            "(strategy.pp.dp=fsdp)")
    stages = d * p.stages_each()
    if p.schedule not in MULTI_STAGE_SCHEDULES and p.stages_each() != 1:
        raise ConfigError(
            f"strategy.pp.schedule={p.schedule} runs one stage per rank, not "
            f"strategy.pp.stages_per_rank={p.stages_per_rank}; fix: stages_per_rank=1, or "
            "schedule=interleaved_1f1b|looped_bfs"
        )
    if p.schedule in V_SCHEDULES and p.stages_each() != 2:
        raise ConfigError(
            f"strategy.pp.schedule={p.schedule} places two stages on each rank (a V), not "
            f"strategy.pp.stages_per_rank={p.stages_per_rank}; fix: stages_per_rank=2 (or 0)")
    if p.schedule in ZERO_BUBBLE and world_size > d * p.tp:
        dims = f"pp{d}" + (f".tp{p.tp}" if p.tp > 1 else "")
        raise ConfigError(
            f"strategy.pp.schedule={p.schedule} splits each backward into its input and weight "
            f"gradients, and the {world_size // (d * p.tp)} data-parallel replicas' gradients are "
            "not reduced right under that split (FSDP replicas drift from one process); fix: one "
            f"pipeline, single@{dims} on {d * p.tp} ranks, or schedule=interleaved_1f1b|1f1b "
            "with replicas")
    if p.schedule == "dualpipev" and p.microbatches < 2 * d:
        raise ConfigError(
            f"strategy.pp.schedule=dualpipev needs strategy.pp.microbatches={p.microbatches} >= "
            f"its {2 * d} stages; fix: strategy.pp.microbatches={2 * d}")
    layers, key = (m.n_layer, "model.n_layer") if m.name == "gpt" else (_hf_layers(m), "model.hf.config.num_hidden_layers")
    if stages > layers:
        raise ConfigError(
            f"{d} ranks x strategy.pp.stages_per_rank={p.stages_each()} = {stages} pipeline "
            f"stages, more than {key}={layers} blocks; fix: fewer stages or more layers"
        )
    if p.schedule == "1f1b" and p.microbatches < d:
        raise ConfigError(
            f"strategy.pp.schedule=1f1b needs strategy.pp.microbatches={p.microbatches} >= the "
            f"pipeline degree {d}; fix: raise strategy.pp.microbatches"
        )
    rounds = max(1, p.microbatches // d)
    if p.schedule in ("interleaved_1f1b", "interleaved_zb") and p.microbatches % rounds:
        raise ConfigError(
            f"strategy.pp.schedule={p.schedule} needs strategy.pp.microbatches="
            f"{p.microbatches} to be a multiple of its {rounds} rounds (microbatches // degree); "
            f"fix: use a multiple of {d}"
        )
    micro = micro_batch_of(cfg, world_size, d * p.tp)
    if micro % p.microbatches:
        raise ConfigError(
            f"the micro batch of {micro} samples per pipeline (train.global_batch_size / "
            f"(data-parallel size x train.grad_accum_steps)) does not split into "
            f"strategy.pp.microbatches={p.microbatches}; fix: make it a multiple of {p.microbatches}"
        )


def _hf_layers(m: Any) -> int:
    from dtlab.config.transformers_config import hf_config

    return int(getattr(hf_config(m), "num_hidden_layers", 0) or 0)


def label(options: dict[str, Any]) -> str:
    return f"pp:{options.get('schedule', '1f1b')}"


SPEC = StrategySpec(
    name="pp", impl="pp:PP", about="pipeline parallelism (gpipe, 1f1b, interleaved, looped, zero bubble)",
    options=PPOptions, variant=("strategy.pp.schedule", PP_SCHEDULES,
                                              f"a schedule ({', '.join(PP_SCHEDULES)})"), mesh_key=KEY,
    check=check, model_parallel=model_parallel, label=label, distinct_ranks=stage_ranks,
    model_dim="pp", flavours=("single", "ddp", "fsdp"), flavour_key="strategy.pp.dp",
    more_dims=(("tp", TP_KEY),),
)
