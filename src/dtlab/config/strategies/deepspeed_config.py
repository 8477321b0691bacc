"""The DeepSpeed config a `strategy.name=deepspeed` run uses, built from dtlab's own keys.

dtlab's train.* keys stay the source of truth: the global batch, the micro batch, the accumulation
steps, gradient clipping and the precision are written into the DeepSpeed config; the optimizer and
the schedule are dtlab's (a torch optimizer handed to `deepspeed.initialize`, driven by dtlab's
LambdaLR). A DeepSpeed JSON (`strategy.deepspeed.config`) supplies everything else. Whatever the
JSON says that contradicts dtlab's keys or `strategy.deepspeed.*` options is refused, so the config
a run reports is the config it ran with. Pure Python: checked before any process starts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

DEFAULT_STAGE = 2
# strategy.deepspeed.<option> -> zero_optimization.<key>, for the options that map one to one.
ZERO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients")
OFFLOADS = ("offload_optimizer", "offload_param")
# ZeRO-Infinity's defaults (docs/zero.md): parameter swap buffers, buffer_count x buffer_size
# elements (a partition must fit one buffer, and a module's parameters must all find one at once;
# DeepSpeed's 5 x 1e8 hold 1 GB in bf16), and no prefetch (seen to fail at the second step with
# small buffers: "already assigned swap buffer id"); a JSON's own values are kept.
NVME_PARAM_BUFFERS = {"buffer_count": 16, "buffer_size": 2_000_000}
PREFETCH_KEYS = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")


def read_json(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"strategy.deepspeed.config: '{path}' not found; fix: pass a DeepSpeed "
                          "JSON, e.g. configs/deepspeed/zero2.json (relative to the working directory)")
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"strategy.deepspeed.config: '{path}' is not valid JSON ({e}); "
                          "fix: correct the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"strategy.deepspeed.config: '{path}' holds a JSON "
                          f"{type(data).__name__}, not an object; fix: write the config as "
                          '{"zero_optimization": {...}, ...}')
    return data


def _unset(value: Any) -> bool:
    return value is None or value == "auto"  # "auto": HF Trainer's placeholder, filled here


def _agree(ds: dict[str, Any], key: str, value: Any, where: str, dtlab_key: str, source: str) -> None:
    """Set ds[key] = value unless the JSON already holds another value (then refuse)."""
    if not _unset(ds.get(key)) and ds[key] != value:
        raise ConfigError(
            f"{source} sets {where}{key}={json.dumps(ds[key])} but {dtlab_key} gives "
            f"{json.dumps(value)}; fix: remove {where}{key} from the JSON (dtlab fills it in) "
            f"or change {dtlab_key}")
    ds[key] = value


def _offload(zero: dict[str, Any], key: str) -> bool:
    device = (zero.get(key) or {}).get("device", "none")
    return device not in (None, "none")


def deepspeed_config(cfg: Config, world_size: int, device_type: str = "cpu") -> dict[str, Any]:
    """The DeepSpeed config dict for `cfg` on `world_size` ranks (raises ConfigError)."""
    o, t = cfg.strategy.deepspeed, cfg.train
    source = f"strategy.deepspeed.config '{o.config}'" if o.config else "the DeepSpeed config"
    ds = copy.deepcopy(read_json(o.config)) if o.config else {}
    for key, owner in (("optimizer", "train.optimizer/lr/betas/weight_decay"),
                       ("scheduler", "train.schedule/warmup_steps"), ("torch_autocast", "train.precision")):
        if key in ds:
            raise ConfigError(f"{source} has a \"{key}\" section, but dtlab sets that from {owner}; "
                              f"fix: remove \"{key}\" from the JSON")

    # Batch, accumulation, clipping: dtlab's keys.
    micro = t.global_batch_size // max(1, world_size * t.grad_accum_steps)
    _agree(ds, "train_batch_size", t.global_batch_size, "", "train.global_batch_size", source)
    _agree(ds, "train_micro_batch_size_per_gpu", micro, "",
           "train.global_batch_size / (world size x train.grad_accum_steps)", source)
    _agree(ds, "gradient_accumulation_steps", t.grad_accum_steps, "", "train.grad_accum_steps", source)
    _agree(ds, "gradient_clipping", float(t.grad_clip), "", "train.grad_clip", source)

    if t.precision == "fp16" and device_type != "cuda":
        raise ConfigError("train.precision=fp16: DeepSpeed's CPU accelerator refuses fp16 (\"Type "
                          "fp16 is not supported on your device\"); fix: use bf16 or fp32 on CPU")
    # Precision: DeepSpeed's own bf16/fp16 modes (low-precision parameters, fp32 master weights).
    for mode in ("bf16", "fp16"):
        section = ds.setdefault(mode, {})
        enabled = section.get("enabled")
        want = t.precision == mode
        if not _unset(enabled) and bool(enabled) != want:
            raise ConfigError(f"{source} sets {mode}.enabled={json.dumps(enabled)} but "
                              f"train.precision={t.precision}; fix: set train.precision="
                              f"{mode if enabled else 'fp32'} or remove {mode}.enabled from the JSON")
        section["enabled"] = want

    # ZeRO: strategy.deepspeed.* options, checked against the JSON.
    zero = ds.setdefault("zero_optimization", {})
    stage = o.zero_stage if o.zero_stage is not None else zero.get("stage", DEFAULT_STAGE)
    _agree(zero, "stage", stage, "zero_optimization.", "strategy.deepspeed.zero_stage", source)
    if stage not in (1, 2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage={stage} is not supported by dtlab; "
                          "fix: use stage 1, 2 or 3 (strategy ddp is dtlab's plain data parallel)")
    for key in ZERO_KEYS:
        value = getattr(o, key)
        if value is not None:
            _agree(zero, key, value, "zero_optimization.", f"strategy.deepspeed.{key}", source)
    for key in OFFLOADS:
        wanted, present = getattr(o, key), _offload(zero, key)
        if wanted is not None and key in zero and wanted != present:
            device = json.dumps((zero[key] or {}).get("device"))
            raise ConfigError(
                f"{source} sets zero_optimization.{key}.device={device} but "
                f"strategy.deepspeed.{key}={str(wanted).lower()}; fix: make them agree")
        if wanted and not present:
            zero[key] = {"device": o.offload_device or "cpu"}
        if _offload(zero, key):
            if key == "offload_param" and stage != 3:
                raise ConfigError(f"zero_optimization.offload_param needs ZeRO stage 3 (this run: "
                                  f"stage {stage}); fix: strategy.deepspeed.zero_stage=3")
            device = zero[key]["device"]
            if o.offload_device is not None and device != o.offload_device:
                raise ConfigError(
                    f"{source} sets zero_optimization.{key}.device={json.dumps(device)} but "
                    f"strategy.deepspeed.offload_device={o.offload_device}; fix: make them agree")
            if device == "nvme":
                nvme_defaults(cfg, zero, key, stage, source)
            if device_type != "cuda":  # pinning host memory needs an accelerator
                if zero[key].get("pin_memory"):
                    raise ConfigError(f"zero_optimization.{key}.pin_memory=true fails without a GPU; "
                                      "fix: set it false (or remove it) in the JSON")
                zero[key]["pin_memory"] = False

    if o.nvme_path is not None and not nvme_offloads(ds):
        raise ConfigError(f"strategy.deepspeed.nvme_path={o.nvme_path} but nothing is offloaded "
                          "to nvme; fix: also set strategy.deepspeed.offload_device=nvme (with "
                          "offload_param and/or offload_optimizer), or remove nvme_path")
    if o.offload_device == "nvme" and not any(_offload(zero, k) for k in OFFLOADS):
        raise ConfigError("strategy.deepspeed.offload_device=nvme but nothing is offloaded; fix: "
                          "also set strategy.deepspeed.offload_param=true and/or "
                          "offload_optimizer=true (with zero_stage=3)")
    # dtlab hands DeepSpeed a torch SGD/AdamW: allowed under ZeRO, and kept under offload (no
    # compiled DeepSpeedCPUAdam, see docs/zero.md).
    ds["zero_allow_untested_optimizer"] = True
    ds["zero_force_ds_cpu_optimizer"] = False
    ds.setdefault("steps_per_print", 2**31 - 1)  # dtlab logs the steps itself
    return ds


def zero_stage(cfg: Config) -> int:
    """The ZeRO stage a run of `cfg` uses (strategy.deepspeed.zero_stage, else the JSON's)."""
    o = cfg.strategy.deepspeed
    if o.zero_stage is not None:
        return o.zero_stage
    zero = (read_json(o.config) if o.config else {}).get("zero_optimization") or {}
    return int(zero.get("stage", DEFAULT_STAGE))


def nvme_path(cfg: Config, zero: dict[str, Any] | None = None) -> str:
    """The directory of the swap files: strategy.deepspeed.nvme_path, else the JSON's, else
    <run.dir>/nvme (inside the run, removed at its end)."""
    o = cfg.strategy.deepspeed
    if o.nvme_path is not None:
        return o.nvme_path
    for key in OFFLOADS:
        path = ((zero or {}).get(key) or {}).get("nvme_path")
        if path:
            return str(path)
    return str(cfg.run.run_dir / "nvme")


def nvme_defaults(cfg: Config, zero: dict[str, Any], key: str, stage: int, source: str) -> None:
    """Fill zero[key] (device nvme) with the swap directory and the defaults that work."""
    if stage != 3:
        raise ConfigError(f"zero_optimization.{key}.device=nvme needs ZeRO stage 3 (this run: "
                          f"stage {stage}); fix: strategy.deepspeed.zero_stage=3")
    if cfg.train.checkpoint_every:
        raise ConfigError(
            f"train.checkpoint_every={cfg.train.checkpoint_every} with NVMe offload: dtlab's "
            "DeepSpeed checkpoints do not cover the state NVMe offload keeps in its swap files "
            "(resuming one fails inside DeepSpeed); fix: train.checkpoint_every=0 "
            "(run.save_model=true still writes the trained weights), or "
            "strategy.deepspeed.offload_device=cpu")
    section = zero[key]
    if cfg.strategy.deepspeed.nvme_path is not None:
        _agree(section, "nvme_path", cfg.strategy.deepspeed.nvme_path, f"zero_optimization.{key}.",
               "strategy.deepspeed.nvme_path", source)
    section.setdefault("nvme_path", nvme_path(cfg, zero))
    if key == "offload_param":
        for name, value in NVME_PARAM_BUFFERS.items():
            section.setdefault(name, value)
    if all(zero.get(name) is None for name in PREFETCH_KEYS):
        zero["stage3_prefetch_bucket_size"] = 0


def nvme_offloads(ds: dict[str, Any]) -> list[str]:
    """The zero_optimization sections (offload_param, offload_optimizer) that go to NVMe."""
    zero = ds.get("zero_optimization") or {}
    return [k for k in OFFLOADS if (zero.get(k) or {}).get("device") == "nvme"]
