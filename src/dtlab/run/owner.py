"""A run directory belongs to one run (docs/reliability.md#one-run-per-directory).

Every checkpoint's manifest records the run that wrote it: `id`, new when a run starts over and
kept across resumes, and `fingerprint`, a hash of the resolved config without the keys that may
change on resume (RESUMABLE). Before any rank starts (`check_start`):
- a run that would start over (resume=none) in a directory holding an earlier run's checkpoints,
  metrics or summary is refused unless run.overwrite=true, which removes them first: a new run's
  checkpoints are never pruned, or later resumed, together with an older run's;
- a resume (auto or PATH) continues only a run whose config differs in RESUMABLE keys at most,
  and only in a directory whose checkpoints are that run's.
While the run trains, its directory is watched (`DirectoryWatch`): deleted or replaced, the run
stops at the next step boundary, and nothing recreates it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from dtlab import files
from dtlab.config.load import flatten
from dtlab.errors import ConfigError, DtlabError, PeerError, RunError
from dtlab.rundir.checkpoints import (
    CheckpointError,
    checkpoint_root,
    complete_checkpoints,
    manifest_json,
)
from dtlab.rundir.hints import earlier_outputs, start_over

# What may change when a run is resumed: how long it runs, how often it evaluates, logs and saves,
# where and how it runs (strategy, world size, device, compile, activation checkpointing), what
# it records, and evaluation-only data settings. Everything else (model, data, optimizer and its
# hyper-parameters, schedule, precision, seed, lab switches) decides the training itself: a change
# there is another run. (lr and momentum would not even apply: they come back from the checkpoint.)
RESUMABLE = ("resume", "run", "strategy", "train.max_steps", "train.epochs", "train.eval_every",
             "train.checkpoint_every", "train.keep_checkpoints", "train.compile",
             "train.compile_backend", "train.activation_checkpointing", "train.ac_every",
             "train.optimizer_impl", "train.nan_policy", "data.dir", "data.download",
             "data.val_limit", "data.val_batch_size", "model.channels_last",
             "lab.no_destroy_process_group")

# What `dtlab train` writes into a run directory; removed when a run starts over there. (Other
# files are left alone: a sweep's config.yaml, run.json and train.log are the sweep's.)
OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.jsonl.tmp", "progress", "summary.json",
           "summary.json.tmp", "model.safetensors", "tb", "trace_rank*.json", "profile", "memory",
           "flight_recorder/*")


# ------------------------------------------------------------------------------ the run's record
def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE)


def fixed_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The config's dotted keys that must not change on resume, with their values."""
    return {k: v for k, v in flatten(config).items() if not _resumable(k)}


def fingerprint(config: dict[str, Any]) -> str:
    blob = json.dumps(fixed_keys(config), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def record(run_id: str, config: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `run` entry."""
    return {"id": run_id, "fingerprint": fingerprint(config)}


def run_id_of(manifest: dict[str, Any]) -> str | None:
    """The id of the run that wrote a checkpoint; None for one written before ids were recorded."""
    run = manifest.get("run")
    return run.get("id") if isinstance(run, dict) and isinstance(run.get("id"), str) else None


def differences(saved: dict[str, Any], config: dict[str, Any], most: int = 3) -> str:
    """The keys that must not change on resume and did, with both values; '' when none did."""
    a, b = fixed_keys(saved), fixed_keys(config)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    said = [f"{k} is {_show(a, k)} in the checkpoint, {_show(b, k)} here" for k in keys[:most]]
    more = f" (and {len(keys) - most} more)" if len(keys) > most else ""
    return "; ".join(said) + more


_ABSENT = object()


def _show(values: dict[str, Any], key: str) -> str:
    return "absent" if key not in values else repr(values[key])


# --------------------------------------------------------------------------- earlier runs' files
def clear_outputs(run_dir: Path) -> None:
    """Remove an earlier run's outputs, so that nothing of it can be read as this run's."""
    for pattern in OUTPUTS:
        for path in Path(run_dir).glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def restarted() -> bool:
    """A worker restarted by torch elastic: the run directory holds this launch's first attempt."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def check_start(cfg: Any) -> None:
    """Before any rank starts: refuse to mix this run with another one in run.dir (DtlabError)."""
    run_dir = cfg.run.run_dir
    if not Path(run_dir).is_dir() or restarted():
        return
    root = checkpoint_root(run_dir)
    if os.path.lexists(root) and not root.is_dir():  # a file of the user's, not dtlab's
        raise ConfigError(f"run.dir '{run_dir}' holds '{root.name}', which is not a directory: "
                          "that is where the run keeps its checkpoints; fix: move that file "
                          "away, or choose another run.dir")
    if cfg.resume == "none":
        found = earlier_outputs(run_dir)
        if found and not cfg.run.overwrite:
            go_on = ", resume=auto to continue it" if "checkpoints up" in found[0] else ""
            raise ConfigError(
                f"run.dir '{run_dir}' holds an earlier run ({', '.join(found)}), which resume=none "
                f"would mix with this one; fix: run.overwrite=true to delete it and start over"
                f"{go_on}, or set another run.dir")
        return
    ids = {}
    for _, path in complete_checkpoints(run_dir, warn=False):
        manifest = manifest_json(path)
        if manifest is not None:
            ids.setdefault(run_id_of(manifest), path.name)
    known = {i: name for i, name in ids.items() if i is not None}
    if cfg.resume == "auto":
        if len(known) > 1:
            raise ConfigError(
                f"run.dir '{run_dir}' holds checkpoints of {len(known)} runs (e.g. "
                f"{', '.join(sorted(known.values()))}), so resume=auto cannot tell which to "
                "continue; fix: move the other run's checkpoints out, or resume=PATH to one")
        found = complete_checkpoints(run_dir, warn=False)
        target = found[-1][1] if found else None
    else:  # resume=PATH: into its own run directory, or one without another run's files
        target = Path(cfg.resume)
        theirs = run_id_of((manifest_json(target) or {}) if target.is_dir() else {})
        found = earlier_outputs(run_dir)
        if found and not cfg.run.overwrite and not inside(target, run_dir) and \
                (theirs is None or theirs not in known):
            raise ConfigError(
                f"run.dir '{run_dir}' holds an earlier run ({', '.join(found)}), which resuming "
                f"'{target}' there would mix with it; fix: run.overwrite=true to delete it, or set "
                "another run.dir")
    manifest = manifest_json(target) if target is not None else None
    if manifest is not None and isinstance(manifest.get("config"), dict):
        check_config(manifest, cfg.model_dump(mode="json"), target, run_dir)


def inside(checkpoint: Path, run_dir: Path) -> bool:
    """Whether `checkpoint` is one of run_dir's own."""
    return checkpoint_root(run_dir).resolve() == Path(checkpoint).resolve().parent


def check_config(manifest: dict[str, Any], config: dict[str, Any], path: Path,
                 run_dir: Path) -> None:
    """Refuse to resume a checkpoint written with another config (keys outside RESUMABLE)."""
    differ = differences(manifest["config"], config)
    if differ:
        raise CheckpointError(
            f"checkpoint '{path}' does not match this run: {differ}; only how long, how often and "
            "where it runs may change on resume (docs/reliability.md#one-run-per-directory); fix: "
            f"resume with the config it was written with, or {start_over(run_dir)}")


def begin(run: Any, ctx: Any, cfg: Any, resumed_from: Path | None,
          watch: DirectoryWatch) -> None:
    """Set-up's last word on the run directory: the run's id (new when it starts over, the
    checkpoint's when it resumes), an earlier run's outputs removed when this one starts over or
    resumes another directory's checkpoint with run.overwrite=true (check_start allowed it), and
    the directory watched from here on."""
    run_dir = cfg.run.run_dir
    if resumed_from is not None and not run.run_id and ctx.is_main:
        print(f"dtlab: warning: checkpoint {resumed_from} records no run id (written before dtlab "
              "recorded them); its config matches, so it is continued as this run",
              file=sys.stderr, flush=True)
    run.run_id = run.run_id or new_run_id()
    if ctx.is_main:
        try:
            if resumed_from is None or (cfg.run.overwrite and not inside(resumed_from, run_dir)):
                clear_outputs(run_dir)
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DtlabError(files.describe(e, f"removing an earlier run's files from run.dir "
                                               f"'{run_dir}'", "run.dir")) from None
        watch.start()
    run.watch = watch


# ------------------------------------------------------------------ a directory that disappears
GONE = 1 << 10  # in the ranks' stop agreement: above every signal number


class RunDirGone(RunError):
    """The run directory was deleted or replaced while the run trained."""


class PeerSawRunDirGone(PeerError):
    exit_code = 1


class DirectoryWatch:
    """The run directory as it was when the run began (its device and inode). Rank 0 watches
    (it writes the run's files); the ranks learn of it in their stop agreement."""

    def __init__(self, run_dir: Path) -> None:
        self.path, self.ident = Path(run_dir), None
        self.lost = False

    def start(self) -> None:
        self.ident = _ident(self.path)

    def problem(self) -> str | None:
        if self.ident is None:
            return None
        now = _ident(self.path)
        if now == self.ident:
            return None
        return "was deleted" if now is None else "was replaced by another directory"

    def intact(self) -> bool:
        """Whether the run may still write there (a failure's records, the stop's line)."""
        return not self.lost and self.problem() is None

    def stop(self, ctx: Any, step: int, what: str | None) -> None:
        """Raise on every rank (RunDirGone on rank 0, which says it)."""
        self.lost = True
        if not ctx.is_main:
            raise PeerSawRunDirGone("rank 0 found the run directory gone")
        raise RunDirGone(self.line(step, what))

    def require(self, step: int) -> None:
        """Rank 0, right before it writes into the run directory: RunDirGone if it is gone."""
        what = self.problem()
        if what:
            self.lost = True
            raise RunDirGone(self.line(step, what))

    def line(self, step: int, what: str | None) -> str:
        return (f"run.dir '{self.path}' {what or 'was deleted or replaced'} during the run; it "
                f"stopped after step {step} and wrote nothing more; fix: leave run.dir in place "
                "while a run uses it (to start over, run.overwrite=true or another run.dir)")


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def check_directory(ctx: Any, watch: DirectoryWatch | None, step: int) -> None:
    """Collective: stop every rank when rank 0 found the run directory gone."""
    if watch is None:
        return
    what = watch.problem()
    if ctx.agree_stop(GONE if what else 0) >= GONE:
        watch.stop(ctx, step, what)
