"""Sweep specs: a base config, overrides for every run, and a matrix whose cross product is run.

    base: configs/quick.yaml
    overrides: {train.max_steps: 50}
    matrix:
      strategy.name: [ddp, fsdp]
      nproc_per_node: [1, 2, 4]
    exclude:                       # optional: combinations to leave out
      - {strategy.name: fsdp, nproc_per_node: 1}
    timeout_s: 900                 # per run
    slurm: {partition: gpu, gpus_per_node: 4, time_min: 30}

Matrix keys are dotted config keys or launcher keys: `nproc_per_node`, `nnodes`, `batch_per_rank`
(sets train.global_batch_size = batch_per_rank x ranks x grad_accum_steps) and, for the SLURM
launcher, `slurm_mode` (`srun`: one task per rank; `torchrun`: one torchrun per node).
Each combination is resolved to a full config; its run directory is named by a hash of that
config and its process layout, so an unchanged run is found again and not re-run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

from dtlab.config import (
    Config,
    check_environment,
    check_value,
    check_world,
    format_validation_error,
    load_config,
    read_yaml,
    valid_keys,
)
from dtlab.errors import ConfigError

LAYOUT_KEYS = ("nproc_per_node", "nnodes", "batch_per_rank", "slurm_mode")


class SlurmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: PositiveInt = 1  # per rank (srun mode); torchrun mode asks nproc x this
    time_min: PositiveInt | None = None  # job time limit; default: the run timeout
    mode: Literal["srun", "torchrun"] = "srun"
    extra: list[str] = Field(default_factory=list)  # more "#SBATCH ..." options, e.g. "--qos=high"
    setup: list[str] = Field(default_factory=list)  # shell lines before the launch (module load ...)
    poll_s: PositiveFloat = 2.0


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    base: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, Any]] = Field(default_factory=list)
    timeout_s: PositiveFloat = 1800.0
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)


@dataclass
class PlannedRun:
    label: str  # what varies, e.g. "strategy.name=ddp nproc_per_node=2"
    combo: dict[str, Any]
    nproc_per_node: int
    nnodes: int
    slurm_mode: str
    key: str = ""  # hash of the resolved config and layout
    config: Config | None = None
    invalid: str | None = None  # why this combination cannot run
    run_dir: Path = field(default_factory=Path)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _fmt(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, (list, dict)) else str(value)


def load_spec(path: str | Path) -> SweepSpec:
    data = read_yaml(path, "sweep spec", "pass an existing sweep spec YAML (docs/sweeps.md)",
                     "write base, overrides and matrix into it (docs/sweeps.md)")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"sweep spec {path}: {format_validation_error(e, False)}") from None
    keys = set(valid_keys())
    for key, values in spec.matrix.items():
        if key not in LAYOUT_KEYS and key not in keys:
            raise ConfigError(
                f"sweep spec {path}: unknown matrix key '{key}'; fix: use a config key "
                f"(dtlab config --keys) or one of {', '.join(LAYOUT_KEYS)}"
            )
        if not values:
            raise ConfigError(f"sweep spec {path}: matrix key '{key}' has no values; fix: list "
                              f"at least one, e.g. {key}: [value], or remove the key")
        twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if twice is not None:  # both would be one run directory: the second run resumes the first
            raise ConfigError(f"sweep spec {path}: matrix key '{key}' lists {_fmt(twice)} twice; "
                              "fix: list each value once")
        for value in values:
            problem = check_layout(key, value) if key in LAYOUT_KEYS else check_value(key, value)
            if problem:
                raise ConfigError(f"sweep spec {path}: matrix value {key}={_fmt(value)}: {problem}; "
                                  f"fix: correct or remove that value under matrix: {key}")
    check_exclude(path, spec)
    if "run.dir" in spec.overrides or "run.dir" in spec.matrix:
        raise ConfigError(f"sweep spec {path}: run.dir is chosen by the sweep (OUT/runs/<hash>); "
                          "fix: remove it from the spec, and give --out DIR")
    if spec.base is not None and not Path(spec.base).is_file():
        # A base relative to the spec file is the natural reading; relative to cwd works too.
        near = Path(path).parent / spec.base
        if near.is_file():
            spec.base = str(near)
    if spec.base is not None:
        read_yaml(spec.base, f"sweep spec {path}: base config file",
                  "set base: to an existing config (relative to the spec or the working directory)",
                  "write its settings into it, or remove base: to use the built-in defaults")
    # Mistakes shared by every run (bad base file, bad override) stop the sweep at once.
    try:
        load_config(spec.base, [f"{k}={_fmt(v)}" for k, v in spec.overrides.items()])
    except ConfigError as e:
        raise ConfigError(f"sweep spec {path}: {e}") from None
    return spec


def check_layout(key: str, value: Any) -> str | None:
    """Why a value of a launcher key (nproc_per_node, nnodes, ...) is wrong, or None."""
    if key == "slurm_mode":
        return None if value in ("srun", "torchrun") else "must be srun or torchrun"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "must be a whole number of at least 1"
    return None


def check_exclude(path: str | Path, spec: SweepSpec) -> None:
    """An exclude entry that can match no combination is a typo: say which part."""
    for entry in spec.exclude:
        for key, value in entry.items():
            if key not in spec.matrix:
                raise ConfigError(f"sweep spec {path}: exclude entry {_fmt(entry)}: '{key}' is "
                                  f"not a matrix key; fix: use one of {', '.join(spec.matrix)}")
            if value not in spec.matrix[key]:
                raise ConfigError(f"sweep spec {path}: exclude entry {_fmt(entry)}: {key}="
                                  f"{_fmt(value)} is not in the matrix; fix: use one of "
                                  f"{', '.join(map(_fmt, spec.matrix[key]))}")


def config_key(cfg: Config, nproc_per_node: int, nnodes: int, slurm_mode: str) -> str:
    """The run's directory name: a hash of its resolved config and ranks, without what the sweep
    sets on each run (where it writes and is tracked, that it may start over: group_trackers,
    expand) so that a run's config.yaml gives its key again (earlier_runs.py)."""
    body = cfg.model_dump(mode="json")
    for key in ("dir", "progress", "overwrite", "mlflow", "wandb"):
        body["run"].pop(key)
    layout = {"nproc_per_node": nproc_per_node, "nnodes": nnodes, "slurm_mode": slurm_mode}
    blob = json.dumps({"config": body, "layout": layout}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def group_trackers(cfg: Config, out_dir: Path, label: str) -> None:
    """A sweep's runs in one place of each tracker: one MLflow experiment named after the sweep
    (in OUT/mlflow.db unless run.mlflow.tracking_uri or MLFLOW_TRACKING_URI names another store), one wandb group; each run
    named by what varies. Settings the spec gives are kept. Set after the run's key is made:
    where a run is tracked does not make it another run."""
    if not cfg.run.active_trackers:
        return
    name = Path(out_dir).resolve().name
    ml, wb = cfg.run.mlflow, cfg.run.wandb
    if ml.tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        ml.tracking_uri = f"sqlite:///{(Path(out_dir) / 'mlflow.db').resolve()}"
    ml.experiment = ml.experiment or name
    ml.run_name = ml.run_name or label
    wb.group = wb.group or name
    wb.name = wb.name or label


def expand(spec: SweepSpec, out_dir: Path, launcher: str) -> list[PlannedRun]:
    """Every combination of the matrix, resolved; invalid ones carry the reason."""
    names = list(spec.matrix)
    plans: list[PlannedRun] = []
    same: dict[str, str] = {}  # run key -> the label of the first combination with it
    for values in itertools.product(*(spec.matrix[n] for n in names)) if names else [()]:
        combo = dict(zip(names, values, strict=True))
        if any(all(combo.get(k) == v for k, v in ex.items()) for ex in spec.exclude):
            continue
        layout = {k: combo.get(k) for k in LAYOUT_KEYS}
        run = PlannedRun(
            label=" ".join(f"{k}={_fmt(v)}" for k, v in combo.items()) or "base",
            combo=combo,
            nproc_per_node=int(layout["nproc_per_node"] or 1),
            nnodes=int(layout["nnodes"] or 1),
            slurm_mode=str(layout["slurm_mode"] or spec.slurm.mode),
        )
        overrides = [f"{k}={_fmt(v)}" for k, v in spec.overrides.items()]
        overrides += [f"{k}={_fmt(v)}" for k, v in combo.items() if k not in LAYOUT_KEYS]
        try:
            cfg = load_config(spec.base, overrides)
            if layout["batch_per_rank"]:
                cfg.train.global_batch_size = (
                    int(layout["batch_per_rank"]) * run.world_size * cfg.train.grad_accum_steps
                )
            if launcher == "local" and run.nnodes > 1:
                raise ConfigError("nnodes > 1 needs the slurm launcher; fix: add --launcher slurm, "
                                  "or keep nnodes at 1")
            if run.slurm_mode not in ("srun", "torchrun"):
                raise ConfigError(f"slurm_mode must be srun or torchrun, not {run.slurm_mode}")
            check_world(cfg, run.world_size, run.nproc_per_node)
            check_environment(cfg)  # a tracker's or strategy's package
        except ConfigError as e:
            run.invalid = str(e)
            plans.append(run)
            continue
        run.key = config_key(cfg, run.nproc_per_node, run.nnodes, run.slurm_mode)
        if run.key in same:  # e.g. train.lr 0.1 and 1e-1: one run directory for two runs
            raise ConfigError(f"matrix combinations '{same[run.key]}' and '{run.label}' are the "
                              "same run (same resolved config and ranks); fix: keep one of the "
                              "values that make them")
        same[run.key] = run.label
        run.run_dir = out_dir / "runs" / run.key
        cfg.run.dir = str(run.run_dir)
        cfg.run.progress = False
        # A run that starts over in its directory (a failed one run again) replaces what it left.
        cfg.run.overwrite = True
        group_trackers(cfg, out_dir, run.label)
        run.config = cfg
        plans.append(run)
    if not plans:
        raise ConfigError("every combination of the matrix is excluded; fix: remove an entry "
                          "under exclude:")
    if all(p.invalid for p in plans):
        raise ConfigError(f"no combination of the matrix can run; the first: {plans[0].invalid}")
    return plans
