"""The configuration schema: sections `model`, `data`, `train`, `strategy`, `run` (and `seed`).

Every section forbids unknown keys. Checks that need the world size (batch divisibility,
HYBRID_SHARD groups, `single` on several ranks) live in `check_world`, run before any process starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from dtlab.errors import ConfigError

STRATEGIES = ("single", "ddp", "fsdp", "fsdp1", "zero1", "deepspeed", "tp", "fsdp_tp", "pp")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs")  # several stages per rank
MODEL_PARALLEL = ("tp", "fsdp_tp", "pp")  # strategies that split the model itself (GPT only)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------------------- model
class CNNConfig(Section):
    """SimpleCNN: one conv stage (conv3x3, [BN], activation, pool 2) per entry of `channels`.

    The defaults (GELU, average pooling) make a smooth network: fp32 rounding differences between
    strategies stay at their own size instead of being amplified by ReLU/max-pool switching
    (measured in docs/strategies.md).
    """

    name: Literal["cnn"] = "cnn"
    channels: list[PositiveInt] = Field(default_factory=lambda: [16, 32], min_length=1)
    hidden: PositiveInt = 64
    batch_norm: bool = False
    activation: Literal["relu", "gelu"] = "gelu"
    pool: Literal["max", "avg"] = "avg"


class ResNetConfig(Section):
    """CIFAR ResNet (3x3 stem, BasicBlocks); `width` multiplies the 64-128-256-512 widths."""

    name: Literal["resnet"] = "resnet"
    depth: Literal[18, 34] = 18
    width: PositiveFloat = 1.0


class GPTConfig(Section):
    """Decoder-only transformer; each block is the sharding unit."""

    name: Literal["gpt"] = "gpt"
    n_layer: PositiveInt = 4
    n_head: PositiveInt = 4
    n_embd: PositiveInt = 128
    block_size: PositiveInt = 64
    vocab_size: PositiveInt = 256
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = True
    tie_weights: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                "fix: choose n_embd as a multiple of n_head"
            )
        return self


ModelConfig = Annotated[CNNConfig | ResNetConfig | GPTConfig, Field(discriminator="name")]


# ------------------------------------------------------------------------------------------ data
class SyntheticConfig(Section):
    """Learnable synthetic data made from the seed (images: class prototypes + noise)."""

    train_samples: PositiveInt = 4096
    val_samples: PositiveInt = 1024
    image_size: PositiveInt = 32
    in_channels: PositiveInt = 3
    num_classes: int = Field(10, ge=2)
    noise: NonNegativeFloat = 10.0


class DataConfig(Section):
    name: Literal["synthetic", "cifar10", "mnist", "tokens"] = "synthetic"
    dir: str = "data"
    download: bool = False
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    train_limit: NonNegativeInt = 0  # use only the first N training samples (0 = all)
    val_limit: NonNegativeInt = 0
    val_batch_size: NonNegativeInt = 0  # 0 = the training micro batch size
    augment: bool = False  # random crop + flip for images (per-rank randomness)


# ----------------------------------------------------------------------------------------- train
class TrainConfig(Section):
    global_batch_size: PositiveInt = 64
    grad_accum_steps: PositiveInt = 1
    max_steps: NonNegativeInt = 0  # 0 = run `epochs` full epochs
    epochs: PositiveInt = 3
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: PositiveFloat = 0.05
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    nesterov: bool = False
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    weight_decay: NonNegativeFloat = 0.0
    schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    lr_scale_base_batch: PositiveInt | None = None  # linear scaling: lr x global_batch / this
    grad_clip: NonNegativeFloat = 0.0  # max global grad norm, 0 = off
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    compile: bool = False
    eval_every: NonNegativeInt = 0  # steps; 0 = at the end of each epoch and of the run
    checkpoint_every: NonNegativeInt = 0  # steps; 0 = no checkpoints (else also one at the end)
    keep_checkpoints: PositiveInt = 2  # the last K complete checkpoints are kept
    nan_policy: Literal["error", "skip"] = "error"  # a non-finite loss or gradient: stop, or skip

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> TrainConfig:
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("train.nesterov needs train.optimizer=sgd and train.momentum > 0")
        return self


# -------------------------------------------------------------------------------------- strategy
class DDPOptions(Section):
    bucket_cap_mb: PositiveFloat = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    # What DDP does with each gradient bucket (src/dtlab/strategies/ddp_hooks.py); ddp only.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd", "topk", "local_sgd"] = "none"
    powersgd_rank: PositiveInt = 1
    powersgd_start_iter: PositiveInt = 2  # plain all-reduce before (PowerSGD needs >= 1)
    topk_ratio: float = Field(0.01, gt=0.0, le=1.0)
    local_sgd_period: PositiveInt = 4  # average parameters every this many steps
    local_sgd_warmup: NonNegativeInt = 0  # plain DDP steps first
    local_sgd_group_size: PositiveInt = 1  # ranks that still average gradients every step


class FSDPOptions(Section):
    """FSDP2 (`fully_shard`), applied to every block and then to the root."""

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    reduce_fp32: bool = True  # with train.precision bf16/fp16: reduce gradients in fp32


class FSDP1Options(Section):
    sharding_strategy: Literal[SHARDING_STRATEGIES] = "FULL_SHARD"  # type: ignore[valid-type]
    auto_wrap: Literal["block", "size", "none"] = "block"
    min_num_params: PositiveInt = 100_000  # for auto_wrap=size
    shard_group_size: NonNegativeInt = 0  # HYBRID_SHARD only: ranks per shard group, 0 = per node
    cpu_offload: bool = False
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "none"] = "BACKWARD_PRE"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    reduce_fp32: bool = True


class Zero1Options(Section):
    """DDP + torch's ZeroRedundancyOptimizer (strategy.ddp.* options apply to the DDP part)."""

    parameters_as_bucket_view: bool = False  # broadcast updated parameters as flat buckets
    overlap_with_ddp: bool = False  # the step inside DDP's backward hook; NCCL only


class DeepSpeedOptions(Section):
    """DeepSpeed ZeRO (the `deepspeed` extra). dtlab's train.* keys (batch, accumulation, clipping,
    precision, optimizer, schedule) are mapped into the DeepSpeed config; `config` (a DeepSpeed
    JSON) supplies the rest. Options left at None take the JSON's value, else DeepSpeed's default;
    a value that contradicts the JSON is refused."""

    config: str | None = None  # path to a DeepSpeed JSON, e.g. configs/deepspeed/zero2.json
    zero_stage: Literal[1, 2, 3] | None = None  # None: the JSON's, else 2
    offload_optimizer: bool | None = None  # optimizer state + fp32 master weights in host memory
    offload_param: bool | None = None  # parameters in host memory (ZeRO 3 only)
    reduce_bucket_size: PositiveInt | None = None  # elements per gradient reduction bucket
    allgather_bucket_size: PositiveInt | None = None  # elements per all-gather (ZeRO 1/2)
    overlap_comm: bool | None = None  # reduce gradients while the backward pass goes on
    contiguous_gradients: bool | None = None  # copy gradients into one buffer as they are made
    shm_comm: bool = False  # DeepSpeed's shared-memory CPU collectives (compiles a C++ op)


class TPOptions(Section):
    """Tensor parallelism (strategies tp and fsdp_tp; src/dtlab/strategies/tp.py)."""

    degree: NonNegativeInt = 0  # ranks per tensor-parallel group; 0 = every rank


class PPOptions(Section):
    """Pipeline parallelism (strategy pp; src/dtlab/strategies/pp.py)."""

    degree: NonNegativeInt = 0  # ranks per pipeline; 0 = every rank
    schedule: Literal[PP_SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    microbatches: PositiveInt = 4  # per micro batch (each rank's batch is split into these)
    stages_per_rank: NonNegativeInt = 0  # 0 = 2 for interleaved_1f1b/looped_bfs, else 1
    dp: Literal["ddp", "fsdp"] = "fsdp"  # how pipeline replicas (world / degree > 1) sync

    def stages_each(self) -> int:
        return self.stages_per_rank or (2 if self.schedule in MULTI_STAGE_SCHEDULES else 1)


class StrategyConfig(Section):
    name: Literal[STRATEGIES] = "single"  # type: ignore[valid-type]
    sync_batchnorm: bool = False
    ddp: DDPOptions = Field(default_factory=DDPOptions)
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    fsdp1: FSDP1Options = Field(default_factory=FSDP1Options)
    zero1: Zero1Options = Field(default_factory=Zero1Options)
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    tp: TPOptions = Field(default_factory=TPOptions)
    pp: PPOptions = Field(default_factory=PPOptions)


# ------------------------------------------------------------------------------------------- run
class FaultConfig(Section):
    """Fault injection, for testing recovery: fires once, on one rank, in the first attempt."""

    kind: Literal["none", "kill", "exit", "hang", "nan", "kill_in_save"] = "none"
    step: PositiveInt = 1
    rank: NonNegativeInt = 0


class LabConfig(Section):
    """Deliberate mistakes, each off by default: turn one on to measure what it costs
    (docs/guide/ shows each with its numbers). Never use them for real training."""

    no_distributed_sampler: bool = False  # every rank draws the same batches (duplicated samples)
    no_zero_grad: bool = False  # gradients of earlier steps are never cleared
    no_loss_division: bool = False  # accumulation sums micro-batch losses instead of averaging
    sync_every_micro_step: bool = False  # gradients synchronised on every accumulation micro step
    per_rank_init_seed: bool = False  # each rank initialises the model with its own seed
    uneven_eval: bool = False  # evaluation without padding: ranks run different batch counts
    no_destroy_process_group: bool = False  # exit without destroying the process group


class RunConfig(Section):
    dir: str | None = None  # None = runs/<config name>-<strategy>
    log_every: PositiveInt = 10
    timing_warmup_steps: NonNegativeInt = 3  # excluded from the medians
    threads: NonNegativeInt = 0  # intra-op threads per rank, 0 = cores / ranks on this node
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: PositiveFloat = 300.0  # process-group timeout: a stuck collective fails after this
    progress: bool | Literal["auto"] = "auto"  # progress bar; auto = when stdout is a terminal
    save_model: bool = False  # write the final full state dict to model.safetensors
    comm_breakdown: bool = False  # after training: compute vs communication (dtlab/comm/breakdown.py)
    breakdown_steps: int = Field(12, ge=2)  # steps per breakdown phase (the first is a warm-up)
    profile_trace: bool = False  # with comm_breakdown: Chrome/Perfetto trace_rank<r>.json
    fault: FaultConfig = Field(default_factory=FaultConfig)
    tensorboard: bool = False
    track_samples: bool = False  # count how often each training sample was used (summary.json)


class Config(Section):
    seed: int = 0
    resume: str = "auto"  # auto: the latest complete checkpoint in run.dir; none; or a path
    model: ModelConfig = Field(default_factory=CNNConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    lab: LabConfig = Field(default_factory=LabConfig)

    @model_validator(mode="before")
    @classmethod
    def _default_model_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            data["model"] = {"name": "cnn", **data["model"]}
        return data

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        is_gpt = self.model.name == "gpt"
        if (is_gpt and self.data.name in ("cifar10", "mnist")) or (
            not is_gpt and self.data.name == "tokens"
        ):
            raise ValueError(
                f"model.name={self.model.name} cannot train on data.name={self.data.name}; "
                "fix: use gpt with data.name=synthetic|tokens, cnn/resnet with synthetic|cifar10|mnist"
            )
        bn = self.model.name == "resnet" or (self.model.name == "cnn" and self.model.batch_norm)
        if self.train.compile and self.strategy.name == "fsdp" and bn:
            raise ValueError(
                "train.compile with strategy fsdp fails on BatchNorm models in this torch release; "
                "fix: set train.compile=false, or use strategy ddp/fsdp1"
            )
        return self


# -------------------------------------------------------------------------------- world checks
def model_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks that hold one copy of the model between them (1 for data-parallel strategies)."""
    s = cfg.strategy
    if s.name in ("tp", "fsdp_tp"):
        return s.tp.degree or world_size
    if s.name == "pp":
        return s.pp.degree or world_size
    return 1


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Replicas the global batch is split over: the ranks not spent on model parallelism."""
    return max(1, world_size // model_parallel_size(cfg, world_size))


def check_model_parallel(cfg: Config, world_size: int) -> None:
    """tp, fsdp_tp and pp: what the mesh, the GPT and the batch must satisfy."""
    s, t, m = cfg.strategy, cfg.train, cfg.model
    name = s.name
    key = "strategy.pp.degree" if name == "pp" else "strategy.tp.degree"
    if not isinstance(m, GPTConfig):
        raise ConfigError(
            f"strategy.name={name} splits a GPT's layers, not model.name={m.name}; "
            "fix: use model.name=gpt, or a data-parallel strategy (ddp, fsdp, fsdp1)"
        )
    degree = model_parallel_size(cfg, world_size)
    if degree > world_size or world_size % degree:
        raise ConfigError(
            f"{key}={degree} does not divide world_size={world_size} into a mesh; "
            f"fix: set {key} to a divisor of {world_size} (0 = every rank)"
        )
    if name == "tp" and degree != world_size:
        raise ConfigError(
            f"strategy.name=tp puts every rank in one tensor-parallel group, but "
            f"strategy.tp.degree={degree} < world_size={world_size}; fix: strategy.tp.degree=0, "
            "or strategy.name=fsdp_tp for a data-parallel dimension"
        )
    if m.tie_weights:
        raise ConfigError(
            f"model.tie_weights with strategy.name={name} is not supported (the embedding and "
            "the head are split differently); fix: set model.tie_weights=false"
        )
    if t.compile or t.precision == "fp16" or cfg.run.comm_breakdown:
        what = ("train.compile" if t.compile else
                "train.precision=fp16" if t.precision == "fp16" else "run.comm_breakdown")
        raise ConfigError(
            f"{what} is not supported with strategy.name={name}; fix: turn it off "
            "(bf16 works for precision)"
        )
    if name in ("tp", "fsdp_tp"):
        for what, value in (("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size),
                            ("model.block_size", m.block_size)):
            if value % degree:
                raise ConfigError(
                    f"{what}={value} is not divisible by the tensor-parallel degree {degree} "
                    f"(heads, vocabulary and sequence are split over it); fix: choose {what} as "
                    f"a multiple of {degree}, or a smaller strategy.tp.degree"
                )
        return
    p = s.pp
    stages = degree * p.stages_each()
    if p.schedule not in MULTI_STAGE_SCHEDULES and p.stages_each() != 1:
        raise ConfigError(
            f"strategy.pp.schedule={p.schedule} runs one stage per rank, not "
            f"strategy.pp.stages_per_rank={p.stages_per_rank}; fix: stages_per_rank=1, or "
            "schedule=interleaved_1f1b|looped_bfs"
        )
    if stages > m.n_layer:
        raise ConfigError(
            f"{degree} ranks x strategy.pp.stages_per_rank={p.stages_each()} = {stages} pipeline "
            f"stages, more than model.n_layer={m.n_layer} blocks; fix: fewer stages or more layers"
        )
    if p.schedule == "1f1b" and p.microbatches < degree:
        raise ConfigError(
            f"strategy.pp.schedule=1f1b needs strategy.pp.microbatches={p.microbatches} >= the "
            f"pipeline degree {degree}; fix: raise strategy.pp.microbatches"
        )
    rounds = max(1, p.microbatches // degree)
    if p.schedule == "interleaved_1f1b" and p.microbatches % rounds:
        raise ConfigError(
            f"strategy.pp.schedule=interleaved_1f1b needs strategy.pp.microbatches="
            f"{p.microbatches} to be a multiple of its {rounds} rounds (microbatches // degree); "
            f"fix: use a multiple of {degree}"
        )


def check_micro_batch(cfg: Config, micro: int) -> None:
    p = cfg.strategy.pp
    if cfg.strategy.name == "pp" and micro % p.microbatches:
        raise ConfigError(
            f"the micro batch of {micro} samples per pipeline (train.global_batch_size / "
            f"(data-parallel size x train.grad_accum_steps)) does not split into "
            f"strategy.pp.microbatches={p.microbatches}; fix: make it a multiple of {p.microbatches}"
        )


def check_world(cfg: Config, world_size: int, local_world_size: int | None = None) -> int:
    """Checks that need the number of ranks; returns the micro batch size per rank."""
    t, s = cfg.train, cfg.strategy
    if s.name == "single" and world_size > 1:
        raise ConfigError(
            f"strategy.name=single runs one process but {world_size} ranks were started; "
            "fix: use --nproc-per-node 1, or strategy.name=ddp|fsdp|fsdp1"
        )
    if s.name == "ddp" and s.ddp.comm_hook == "local_sgd" and t.checkpoint_every:
        raise ConfigError(
            "train.checkpoint_every with strategy.ddp.comm_hook=local_sgd is not supported (its "
            "optimizer wrapper has no distributed state dict); fix: set one of them off"
        )
    if s.name == "ddp" and s.ddp.comm_hook == "local_sgd" and world_size % s.ddp.local_sgd_group_size:
        raise ConfigError(
            f"strategy.ddp.local_sgd_group_size={s.ddp.local_sgd_group_size} does not divide "
            f"world_size={world_size}; fix: choose a divisor"
        )
    if s.name == "zero1":
        check_zero1(cfg)
    if s.name in MODEL_PARALLEL:
        check_model_parallel(cfg, world_size)
    dp = data_parallel_size(cfg, world_size)
    per_step = dp * t.grad_accum_steps
    if t.global_batch_size < per_step or t.global_batch_size % per_step:
        what = f"world_size({world_size})" if dp == world_size else f"data-parallel size({dp})"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
            f"{what} x train.grad_accum_steps({t.grad_accum_steps}) = {per_step}; "
            f"fix: set train.global_batch_size to a multiple of {per_step}"
        )
    if s.name == "fsdp1" and s.fsdp1.sharding_strategy == "HYBRID_SHARD":
        group = s.fsdp1.shard_group_size or local_world_size or world_size
        if group < 1 or world_size % group:
            raise ConfigError(
                f"HYBRID_SHARD cannot split world_size={world_size} into shard groups of {group}; "
                "fix: set strategy.fsdp1.shard_group_size to a divisor of the world size"
            )
    if s.name == "deepspeed":
        check_deepspeed(cfg, world_size)
    check_micro_batch(cfg, t.global_batch_size // per_step)
    return t.global_batch_size // per_step


def device_type(cfg: Config) -> str:
    """The device type a run will use (imports torch only when run.device=auto)."""
    if cfg.run.device != "auto":
        return cfg.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_zero1(cfg: Config) -> None:
    z, hook = cfg.strategy.zero1, cfg.strategy.ddp.comm_hook
    if hook == "local_sgd":
        raise ConfigError(
            "strategy.ddp.comm_hook=local_sgd does not combine with strategy zero1 (post-local SGD "
            "wraps the optimizer and averages parameters itself); fix: use strategy ddp, or "
            "another comm_hook")
    if not z.overlap_with_ddp:
        return
    backend = cfg.run.backend
    if backend == "gloo" or (backend == "auto" and device_type(cfg) == "cpu"):
        raise ConfigError(
            "strategy.zero1.overlap_with_ddp=true needs the NCCL backend (PyTorch's "
            "hook_with_zero_step refuses gloo, which may hang); fix: set it false on CPU/gloo")
    clash = [k for k, on in (("strategy.ddp.comm_hook", hook != "none"),
                             ("train.grad_clip", cfg.train.grad_clip > 0),
                             ("train.checkpoint_every", cfg.train.checkpoint_every > 0)) if on]
    if clash:
        raise ConfigError(
            f"strategy.zero1.overlap_with_ddp=true runs the optimizer step inside DDP's backward "
            f"hook, so {', '.join(clash)} cannot apply; fix: turn those off or set "
            "overlap_with_ddp=false")


def check_deepspeed(cfg: Config, world_size: int) -> None:
    from dtlab.config.deepspeed import deepspeed_config

    t = cfg.train
    if t.checkpoint_every or cfg.resume not in ("auto", "none"):
        raise ConfigError(
            "checkpoints are not supported with strategy deepspeed (its ZeRO partitions do not map "
            "onto dtlab's DCP checkpoints); fix: set train.checkpoint_every=0 and resume=auto|none")
    if t.compile:
        raise ConfigError("train.compile with strategy deepspeed is not supported; "
                          "fix: set train.compile=false")
    deepspeed_config(cfg, world_size, device_type(cfg))  # refuses contradictions


def check_environment(cfg: Config) -> None:
    """Options that need an optional package."""
    import importlib.util

    if cfg.strategy.name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "strategy.name=deepspeed needs the deepspeed package; "
            "fix: pip install 'dtlab[deepspeed]' (after the pinned torch), or choose another strategy")
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "run.tensorboard=true needs the tensorboard package; "
            "fix: pip install 'dtlab[tensorboard]', or set run.tensorboard=false"
        )
