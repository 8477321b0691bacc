"""`deepspeed`: DeepSpeed ZeRO 1/2/3; its options and checks (implementation: deepspeed.py, the
DeepSpeed config it builds: deepspeed_config.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import PositiveInt

from dtlab.config.device import device_type
from dtlab.config.options import Section, UserPath
from dtlab.config.strategies.spec import StrategySpec, micro_batch_of
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


class DeepSpeedOptions(Section):
    """DeepSpeed ZeRO (the `deepspeed` extra). dtlab's train.* keys (batch, accumulation, clipping,
    precision, optimizer, schedule) are mapped into the DeepSpeed config; `config` (a DeepSpeed
    JSON) supplies the rest. Options left at None take the JSON's value, else DeepSpeed's default;
    a value that contradicts the JSON is refused."""

    config: UserPath | None = None  # path to a DeepSpeed JSON, e.g. configs/deepspeed/zero2.json
    zero_stage: Literal[1, 2, 3] | None = None  # None: the JSON's, else 2
    offload_optimizer: bool | None = None  # optimizer state + fp32 master weights in host memory
    offload_param: bool | None = None  # parameters in host memory (ZeRO 3 only)
    # Where the offloaded state goes: host memory, or files on an NVMe disk (ZeRO-Infinity, ZeRO 3
    # only, needs libaio; see docs/zero.md). None: the JSON's device, else cpu.
    offload_device: Literal["cpu", "nvme"] | None = None
    nvme_path: UserPath | None = None  # the swap files' directory; None: the JSON's, else <run.dir>/nvme
    reduce_bucket_size: PositiveInt | None = None  # elements per gradient reduction bucket
    allgather_bucket_size: PositiveInt | None = None  # elements per all-gather (ZeRO 1/2)
    overlap_comm: bool | None = None  # reduce gradients while the backward pass goes on
    contiguous_gradients: bool | None = None  # copy gradients into one buffer as they are made
    shm_comm: bool = False  # DeepSpeed's shared-memory CPU collectives (compiles a C++ op)


def check(cfg: Config, world_size: int, local_world_size: int | None) -> None:
    from dtlab.config.strategies.deepspeed_config import deepspeed_config

    micro_batch_of(cfg, world_size)  # a batch that does not split is the first thing to say
    t = cfg.train
    if t.compile != "none":
        raise ConfigError(f"train.compile={t.compile} with strategy deepspeed is not supported; "
                          "fix: set train.compile=none")
    if t.activation_checkpointing != "none":  # ZeRO-3 gathers parameters in its own hooks
        raise ConfigError(
            f"train.activation_checkpointing={t.activation_checkpointing} with strategy deepspeed "
            "is not supported (DeepSpeed recomputes through its own deepspeed.checkpointing API); "
            "fix: set train.activation_checkpointing=none")
    deepspeed_config(cfg, world_size, device_type(cfg))  # refuses contradictions


def environment(cfg: Config) -> None:
    from dtlab.config.strategies.deepspeed_aio import check

    check(cfg)  # NVMe offload: the swap directory and DeepSpeed's async_io op


def layout(cfg: Config) -> str:
    from dtlab.config.strategies.deepspeed_config import zero_stage

    return f"zero{zero_stage(cfg)}"


def label(options: dict[str, Any]) -> str:
    stage = options.get("zero_stage")
    return f"deepspeed:{stage}" if stage else "deepspeed"


SPEC = StrategySpec(
    name="deepspeed", impl="deepspeed:DeepSpeed", about="DeepSpeed ZeRO stage 1, 2 or 3",
    options=DeepSpeedOptions, variant=("strategy.deepspeed.zero_stage", ("1", "2", "3"),
                                        "its ZeRO stage (deepspeed:1, :2 or :3)"),
    extra=("deepspeed", "deepspeed"), check=check, environment=environment, label=label, layout=layout,
    memory_model="deepspeed_memory", master_weights=True, trace_warmup=2,
)
