"""The configuration schema: sections `model`, `data`, `train`, `strategy`, `parallel`, `run`
(and `seed`).

Every section forbids unknown keys. Each strategy's options and checks live beside it
(dtlab/strategies/<name>_spec.py); checks that need the world size are in world.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    create_model,
    field_validator,
    model_validator,
)

from dtlab.config import layout
from dtlab.config.layout import ParallelConfig
from dtlab.config.options import Section, UserPath
from dtlab.config.strategies import registry
from dtlab.config.transformers_config import hf_config
from dtlab.errors import ConfigError

STRATEGIES = registry.NAMES


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
    channels_last: bool | Literal["auto"] = "auto"  # NHWC weights and inputs; auto = on CUDA


class ResNetConfig(Section):
    """CIFAR ResNet (3x3 stem, BasicBlocks); `width` multiplies the 64-128-256-512 widths."""

    name: Literal["resnet"] = "resnet"
    depth: Literal[18, 34] = 18
    width: PositiveFloat = 1.0
    channels_last: bool | Literal["auto"] = "auto"  # NHWC weights and inputs; auto = on CUDA


class GPTConfig(Section):
    """Decoder-only transformer; each block is the sharding unit."""

    name: Literal["gpt"] = "gpt"
    VOCAB_KEY: ClassVar[str] = "model.vocab_size"
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


class HFOptions(Section):
    """Where a Hugging Face model comes from: `path` (a local directory with config.json and
    weights, e.g. a `dtlab export --format hf`; or a hub id when online) and/or `config` (config
    fields: with `path` they override its config.json, alone they need `model_type` and the model
    is initialised randomly from the seed)."""

    path: UserPath | None = None
    config: dict[str, Any] | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"  # the parameters' dtype (bf16: pure bf16 training)


class HFConfig(Section):
    """A causal LM of Hugging Face transformers (the `hf` extra); its decoder layers are the
    sharding and checkpointing units (dtlab/models/hf.py)."""

    name: Literal["hf"] = "hf"
    VOCAB_KEY: ClassVar[str] = "model.hf.config.vocab_size"
    hf: HFOptions = Field(default_factory=HFOptions)
    block_size: PositiveInt = 64  # the training sequence length

    @model_validator(mode="after")
    def _has_a_source(self) -> HFConfig:
        o = self.hf
        if o.path is None and not (o.config and "model_type" in o.config):
            raise ValueError(
                "model.name=hf needs model.hf.path (a model directory) or model.hf.config with a "
                "model_type; fix: e.g. model.hf.path=./my-llama, or model.hf.config.model_type=llama"
            )
        return self

    @property
    def vocab_size(self) -> int:
        return hf_config(self).vocab_size


ModelConfig = Annotated[CNNConfig | ResNetConfig | GPTConfig | HFConfig,
                        Field(discriminator="name")]
LANGUAGE_MODELS = ("gpt", "hf")  # the models that train on token sequences


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
    dir: UserPath = "data"
    download: bool = False
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    train_limit: NonNegativeInt = 0  # use only the first N training samples (0 = all)
    val_limit: NonNegativeInt = 0
    val_batch_size: NonNegativeInt = 0  # 0 = the training micro batch size
    augment: bool = False  # random crop + flip for images (per-rank randomness)


# ----------------------------------------------------------------------------------------- train
class LoraConfig(Section):
    """LoRA adapters (dtlab/levers/lora.py, the `lora` extra): rank 0 = off (the whole model trains)."""

    rank: NonNegativeInt = 0
    alpha: PositiveFloat = 16.0  # the adapters' update is scaled by alpha / rank
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


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
    # auto: fused where the parameters' device has fused kernels, else foreach (dtlab/levers/optim.py)
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    lr_scale_base_batch: PositiveInt | None = None  # linear scaling: lr x global_batch / this
    grad_clip: NonNegativeFloat = 0.0  # max global grad norm, 0 = off
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # torch.compile: none, the wrapped model, or each block before wrapping (dtlab/levers/compile.py);
    # true/false mean model/none
    compile: Literal["none", "model", "blocks"] = "none"
    # torch.compile's backend (torchtitan's compile.backend): aot_eager traces without inductor's
    # code generation, to tell a tracing problem from a generated-kernel one
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # recompute activations in the backward: every block (full) or every ac_every-th (selective)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: PositiveInt = 2
    eval_every: NonNegativeInt = 0  # steps; 0 = at the end of each epoch and of the run
    checkpoint_every: NonNegativeInt = 0  # steps; 0 = no checkpoints (else also one at the end)
    keep_checkpoints: PositiveInt = 2  # the last K complete checkpoints are kept
    nan_policy: Literal["error", "skip"] = "error"  # a non-finite loss or gradient: stop, or skip
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_bool(cls, value: Any) -> Any:
        return ("model" if value else "none") if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> TrainConfig:
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("train.nesterov needs train.optimizer=sgd and train.momentum > 0; "
                             "fix: set those, or train.nesterov=false")
        return self


# -------------------------------------------------------------------------------------- strategy
# `strategy.name`, `strategy.sync_batchnorm`, and one section of options per strategy that has
# them, declared beside the strategy (dtlab/strategies/<name>_spec.py) and listed by the registry.
StrategyConfig = create_model(
    "StrategyConfig", __base__=Section,
    name=(Literal[registry.NAMES], registry.REFERENCE),  # type: ignore[valid-type]
    sync_batchnorm=(bool, False),
    **{spec.name: (spec.options, Field(default_factory=spec.options))
       for spec in registry.SPECS.values() if spec.options is not None},
)


# ------------------------------------------------------------------------------------------- run
class FaultConfig(Section):
    """Fault injection, for testing recovery: fires once, on one rank, in the first attempt."""

    kind: Literal["none", "kill", "exit", "hang", "nan", "kill_in_save", "oom"] = "none"
    step: PositiveInt = 1
    rank: NonNegativeInt = 0


class ProfileConfig(Section):
    """A torch.profiler window over steps [start, start + steps) of the run: a trace per rank and
    the step split into data, compute, optimizer and communication (dtlab/instruments/profile_window.py)."""

    start: PositiveInt = 5  # after the first steps' warm-up
    steps: NonNegativeInt = 0  # 0 = off
    memory: bool = False  # every allocation, and the memory timeline by category
    record_shapes: bool = False
    with_stack: bool = False


class MemorySnapshotConfig(Section):
    """CUDA: the allocator's history over steps [start, start + steps), for PyTorch's memory
    viewer (dtlab/instruments/memory_snapshot.py). On CPU the profiler's memory timeline is written instead."""

    start: PositiveInt = 2  # the first step allocates the optimizer state
    steps: NonNegativeInt = 0  # 0 = off
    max_entries: PositiveInt = 100_000  # allocations and frees kept


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


TRACKERS = ("tensorboard", "mlflow", "wandb")
# the package each tracker imports, and the dtlab extra that installs it
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
                    "wandb": ("wandb", "wandb")}


class MlflowOptions(Section):
    """Where run.trackers=[mlflow] logs (dtlab/instruments/trackers/mlflow.py)."""

    # None: $MLFLOW_TRACKING_URI where set, else a sqlite store in the run directory,
    # sqlite:///RUN_DIR/mlflow.db (offline; `mlflow ui --backend-store-uri` reads it); or a
    # server's http(s):// address
    tracking_uri: str | None = None
    experiment: str | None = None  # None: "dtlab" (a sweep's runs: the sweep's name)
    run_name: str | None = None  # None: the run directory's name (in a sweep: what varies)


class WandbOptions(Section):
    """Where run.trackers=[wandb] logs (dtlab/instruments/trackers/wandb.py)."""

    # None: $WANDB_MODE where set, else offline; online: after `wandb login`
    mode: Literal["offline", "online"] | None = None
    project: str = "dtlab"
    entity: str | None = None
    group: str | None = None  # None: none (a sweep's runs: the sweep's name)
    name: str | None = None  # None: the run directory's name (in a sweep: what varies)


class RunConfig(Section):
    dir: UserPath | None = None  # None = runs/<config name>-<strategy>
    # a run that starts over (resume=none) deletes an earlier run's checkpoints, metrics and
    # summary in run.dir first; without it, it refuses to start beside them (dtlab/run/owner.py)
    overwrite: bool = False
    log_every: PositiveInt = 10
    timing_warmup_steps: NonNegativeInt = 3  # excluded from the medians
    # intra-op threads per rank, 0 = cores / ranks on this node (torch's pools take a C int; 4096
    # is past any node's cores)
    threads: int = Field(0, ge=0, le=4096)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: PositiveFloat = 300.0  # process-group timeout: a stuck collective fails after this
    progress: bool | Literal["auto"] = "auto"  # progress bar; auto = when stdout is a terminal
    save_model: bool = False  # write the final full state dict to model.safetensors
    comm_breakdown: bool = False  # after training: compute vs communication (dtlab/instruments/breakdown.py)
    breakdown_steps: int = Field(12, ge=2)  # steps per breakdown phase (the first is a warm-up)
    profile_trace: bool = False  # with comm_breakdown: Chrome/Perfetto trace_rank<r>.json
    fault: FaultConfig = Field(default_factory=FaultConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    memory_snapshot: MemorySnapshotConfig = Field(default_factory=MemorySnapshotConfig)
    # collectives each rank remembers, written to RUN_DIR/flight_recorder/ when a run fails or is
    # stopped (dtlab/instruments/flight_recorder.py); 0 = off
    flight_recorder: NonNegativeInt = 2000
    # Also save a checkpoint and stop on this signal (SIGTERM always does), e.g. USR1 with
    # `sbatch --signal=USR1@90`: docs/reliability.md#signals
    checkpoint_signal: Literal["USR1", "USR2"] | None = None
    # a rank's peak TFLOP/s for MFU, when the device is not in dtlab/instruments/flops.py's table
    peak_tflops: float | None = None
    # experiment trackers, each logging from rank 0 (docs/observability.md#experiment-trackers)
    trackers: list[Literal[TRACKERS]] = Field(default_factory=list)  # type: ignore[valid-type]
    mlflow: MlflowOptions = Field(default_factory=MlflowOptions)
    wandb: WandbOptions = Field(default_factory=WandbOptions)
    tensorboard: bool = False  # the same as listing tensorboard in run.trackers
    track_samples: bool = False  # count how often each training sample was used (summary.json)
    # numerics (dtlab/levers/numerics.py): the same bits on every run of a command (GPU), TF32 matmuls
    # and convolutions (fp32 runs on Ampere and later), cuDNN autotuning (auto: on CUDA unless
    # deterministic)
    deterministic: bool = False
    tf32: bool = False
    cudnn_benchmark: bool | Literal["auto"] = "auto"

    @field_validator("peak_tflops")
    @classmethod
    def _plausible_peak(cls, v: float | None) -> float | None:
        # a slow CPU core to beyond any accelerator's low-precision peak: outside, MFU is noise
        if v is not None and not 1e-3 <= v <= 1e5:
            raise ValueError(f"run.peak_tflops={v:g} is no device's peak TFLOP/s per rank (0.001 "
                             "to 100000); fix: the datasheet's dense TFLOP/s for the run's "
                             "precision, e.g. run.peak_tflops=989 (H100, bf16), or leave it unset")
        return v

    @field_validator("trackers")
    @classmethod
    def _each_tracker_once(cls, v: list[str]) -> list[str]:
        twice = next((t for i, t in enumerate(v) if t in v[:i]), None)
        if twice is not None:
            raise ValueError(f"run.trackers lists {twice} twice; fix: list each tracker once")
        return v

    @property
    def active_trackers(self) -> list[str]:
        """run.trackers, with tensorboard when run.tensorboard=true."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.trackers else []
        return [*self.trackers, *extra]

    @property
    def run_dir(self) -> Path:
        """Where the run writes: run.dir, or runs/default for a worker started without one."""
        return Path(self.dir or "runs/default")

    @model_validator(mode="after")
    def _deterministic_without_autotuning(self) -> RunConfig:
        if self.deterministic and self.cudnn_benchmark is True:
            raise ValueError("run.deterministic=true with run.cudnn_benchmark=true: autotuning "
                             "picks kernels by timing, so runs differ; fix: set "
                             "run.cudnn_benchmark=auto or false")
        return self


def _resume_word(value: Any) -> Any:
    """YAML reads resume=yes/no/true/false as a boolean, which no string check would name."""
    if isinstance(value, bool):
        raise ValueError("resume is given as a yes/no (yes, no, true or false), but it takes "
                         "auto (the latest checkpoint in run.dir), none (start over) or a "
                         "checkpoint's path; fix: resume=auto, resume=none or resume=PATH")
    return value


class Config(Section):
    seed: int = 0
    # auto: the latest complete checkpoint in run.dir; none; or a path
    resume: Annotated[UserPath, BeforeValidator(_resume_word)] = "auto"
    model: ModelConfig = Field(default_factory=CNNConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    lab: LabConfig = Field(default_factory=LabConfig)

    @model_validator(mode="before")
    @classmethod
    def _layout(cls, data: Any) -> Any:
        """parallel.* degrees into the keys of the strategy that runs them (config/layout.py)."""
        if not isinstance(data, dict):
            return data
        try:
            return layout.resolve(data)
        except ConfigError as e:  # pydantic reports ValueErrors as the config's problem
            raise ValueError(str(e)) from None

    @model_validator(mode="before")
    @classmethod
    def _default_model_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            data["model"] = {"name": "cnn", **data["model"]}
        return data

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        is_lm = self.model.name in LANGUAGE_MODELS
        if (is_lm and self.data.name in ("cifar10", "mnist")) or (
            not is_lm and self.data.name == "tokens"
        ):
            raise ValueError(
                f"model.name={self.model.name} cannot train on data.name={self.data.name}; "
                "fix: use gpt or hf with data.name=synthetic|tokens, cnn/resnet with "
                "synthetic|cifar10|mnist"
            )
        spec = registry.of(self)
        if spec.validate is not None:
            try:
                spec.validate(self)
            except ConfigError as e:  # pydantic reports ValueErrors as the config's problem
                raise ValueError(str(e)) from None
        return self
