"""A run directory belongs to one run (docs/reliability.md#one-run-per-directory).

Every checkpoint's manifest records the run that wrote it: `id`, new when a run starts over and
kept across resumes, and `fingerprint`, a hash of the resolved config without the keys that may
change on resume (RESUMABLE). Before any rank starts (`check_start`):
- a run that would start over (resume=none) in a directory holding an earlier run's checkpoints,
  metrics or summary is refused unless run.overwrite=true, which removes them first: a new run's
  checkpoints are never pruned, or later resumed, together with an older run's;
- a resume (auto or PATH) continues only a run whose config differs in RESUMABLE keys at most,
  and only in a directory whose checkpoints are that run's.
While the run trains, its directory is watched (dir_watch.py), and held by one process at a
time (dir_lock.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from dtlab import files, owned
from dtlab.config import Config
from dtlab.config.load import flatten
from dtlab.errors import ConfigError, DtlabError
from dtlab.run.data_identity import data_changes, data_identity
from dtlab.run.dir_watch import DirectoryWatch
from dtlab.run.neighbours import OUTPUT_NAMES, OUTPUTS, check_owned, run_id_of
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
RESUMABLE = ("resume", "run", "strategy", "parallel", "train.max_steps", "train.epochs", "train.eval_every",
             "train.checkpoint_every", "train.keep_checkpoints", "train.compile",
             "train.compile_backend", "train.activation_checkpointing", "train.ac_every",
             "train.optimizer_impl", "train.nan_policy", "data.dir", "data.download",
             "data.val_limit", "data.val_batch_size", "model.channels_last",
             "lab.no_destroy_process_group")

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
    return {"id": run_id, "fingerprint": fingerprint(config), "data": data_identity(config)}


def as_read_now(saved: dict[str, Any]) -> dict[str, Any]:
    """A config an earlier dtlab saved, as this one reads it: keys added since at their
    defaults (as it is unchanged when it no longer validates)."""
    try:
        return Config.model_validate(saved).model_dump(mode="json")
    except (ValueError, DtlabError):
        return saved


def differences(saved: dict[str, Any], config: dict[str, Any], most: int = 3) -> str:
    """The keys that must not change on resume and did, with both values; '' when none did."""
    a, b = fixed_keys(as_read_now(saved)), fixed_keys(config)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    said = [f"{k} is {_show(a, k)} in the checkpoint, {_show(b, k)} here" for k in keys[:most]]
    more = f" (and {len(keys) - most} more)" if len(keys) > most else ""
    return "; ".join(said) + more


_ABSENT = object()


def _show(values: dict[str, Any], key: str) -> str:
    return "absent" if key not in values else repr(values[key])


# --------------------------------------------------------------------------- earlier runs' files
def clear_outputs(run_dir: Path) -> list[str]:
    """Remove an earlier run's outputs, so that nothing of it can be read as this run's (its
    report too, when `dtlab report` wrote one there). Returns the names removed."""
    removed = []
    report = Path(run_dir) / "report.html"
    if files.is_dtlab_report(report):
        report.unlink()
        removed.append(report.name)
    for pattern in OUTPUTS:
        for path in sorted(Path(run_dir).glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path.relative_to(run_dir)))
    return removed


def clear_end_outputs(run_dir: Path) -> list[str]:
    """A resumed run's earlier end: its exported weights, which would stand beside the resumed
    run's checkpoints and summary as if they were its own (written again at its end). `dtlab
    report`'s page is not the run's to remove: check_start refuses a resume beside it."""
    path = Path(run_dir) / "model.safetensors"
    if path.is_file() and not path.is_symlink():
        path.unlink()
        return [path.name]
    return []


def check_no_report(run_dir: Path) -> None:
    """A run that goes on beside `dtlab report`'s page of it so far would leave the page
    describing a run that is no longer so; the page is report's, so it is refused, not removed."""
    report = Path(run_dir) / "report.html"
    if files.is_dtlab_report(report):
        raise ConfigError(f"run.dir '{run_dir}' holds report.html, which `dtlab report` made of "
                          "the run so far and which would describe it wrongly once it goes on; "
                          f"fix: move it away (dtlab report {run_dir} makes a new one), or "
                          "choose another run.dir")


def restarted() -> bool:
    """A worker restarted by torch elastic: the run directory holds this launch's first attempt."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def check_start(cfg: Any, config: str | None = None) -> None:
    """Before any rank starts: refuse to mix this run with another one in run.dir (DtlabError).
    `config`: the file the run's config was read from (--config)."""
    run_dir = cfg.run.run_dir
    if not Path(run_dir).is_dir() or restarted():
        return
    root = checkpoint_root(run_dir)
    if os.path.lexists(root) and not root.is_dir():  # a file of the user's, not dtlab's
        raise ConfigError(f"run.dir '{run_dir}' holds '{root.name}', which is not a directory: "
                          "that is where the run keeps its checkpoints; fix: move that file "
                          "away, or choose another run.dir")
    check_owned(cfg, config)
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
        earlier = earlier_outputs(run_dir)
        if target is None and earlier and not cfg.run.overwrite:
            raise ConfigError(
                f"run.dir '{run_dir}' holds an earlier run ({', '.join(earlier)}) and no "
                f"checkpoint to continue it from: {why_no_checkpoint(run_dir)}; resume=auto would "
                "start over and delete it; fix: run.overwrite=true to start over, or set "
                "another run.dir")
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
    if target is not None and not cfg.run.overwrite:
        check_no_report(run_dir)
    manifest = manifest_json(target) if target is not None else None
    if manifest is not None and isinstance(manifest.get("config"), dict):
        check_config(manifest, cfg.model_dump(mode="json"), target, run_dir)


def why_no_checkpoint(run_dir: Path) -> str:
    """What became of an earlier run's checkpoints, as far as run.dir tells."""
    root = checkpoint_root(run_dir)
    record = owned.read(run_dir) or {}
    saved = record.get("last_checkpoint")
    kept = f" (it had saved step {saved})" if isinstance(saved, int) else ""
    if not root.is_dir():
        return (f"checkpoints/ was deleted{kept}" if kept else
                "it saved none (stopped before its first, or train.checkpoint_every=0)")
    names = sorted(p.name for p in root.iterdir())
    steps = [n for n in names if n.startswith("step_")]
    if steps:
        return (f"{owned.shown(steps, 2)} {'has' if len(steps) == 1 else 'have'} no manifest "
                "(emptied or changed outside dtlab)")
    if names:
        return "its last save was cut short (only a .tmp- directory is left)"
    return f"checkpoints/ was emptied{kept}" if kept else "checkpoints/ is empty"


class RunComplete(DtlabError):
    """A finished run started again with nothing left to train: said in one line, exit 0."""

    exit_code = 0


def summary_step(run_dir: Path) -> int | None:
    """The last step run.dir's summary describes (None without a readable summary)."""
    try:
        s = json.loads((Path(run_dir) / "summary.json").read_text())
        return int((s.get("resumed_from") or {}).get("step", 0)) + int(s["steps"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def note_checkpoint(run_dir: Path, run_id: str, step: int) -> None:
    """Rank 0, after a checkpoint is published: the run's record keeps its last step, so that a
    later start can say what became of checkpoints that went missing (why_no_checkpoint)."""
    mine = _record_of(run_dir, run_id)
    if mine is None:
        return
    with contextlib.suppress(DtlabError):  # the checkpoint itself is safe: only the note is lost
        mine.add(last_checkpoint=step)


def _record_of(run_dir: Path, run_id: str) -> owned.Owned | None:
    """run.dir's record when it is this run's (a resumed run keeps what it noted), else None."""
    rec = owned.read(run_dir)
    if rec is None or rec.get("kind") != "run" or rec.get("owner") != run_id:
        return None
    return owned.reopened(run_dir, rec)


def inside(checkpoint: Path, run_dir: Path) -> bool:
    """Whether `checkpoint` is one of run_dir's own."""
    return checkpoint_root(run_dir).resolve() == Path(checkpoint).resolve().parent


def check_config(manifest: dict[str, Any], config: dict[str, Any], path: Path,
                 run_dir: Path) -> None:
    """Refuse to resume a checkpoint written with another config (keys outside RESUMABLE)."""
    data_dir = (config.get("data") or {}).get("dir")
    changed = data_changes((manifest.get("run") or {}).get("data"), data_identity(config),
                           Path(data_dir) if data_dir else None)
    if changed:
        raise CheckpointError(
            f"checkpoint '{path}' was trained on other data than data.dir "
            f"'{(config.get('data') or {}).get('dir')}' holds now: {changed} changed since (e.g. "
            "`dtlab prepare` run again on other text); fix: resume with the data it was trained "
            f"on, or {start_over(run_dir)}")
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
                removed, why = clear_outputs(run_dir), "this run starts over"
            else:  # what described the run's end so far: written again at this one's end
                removed, why = clear_end_outputs(run_dir), "the weights of its earlier end"
            if removed:  # dtlab's own files of the earlier run, and said: nothing goes unnoticed
                print(f"dtlab: removed the earlier run's {owned.shown(removed)} from run.dir "
                      f"'{run_dir}' ({why})", file=sys.stderr, flush=True)
            # Recorded before the first output is written: whatever this run leaves is its own.
            mine = _record_of(run_dir, run.run_id) or owned.Owned(Path(run_dir), "run", run.run_id)
            mine.add(*OUTPUT_NAMES)
        except OSError as e:
            raise DtlabError(files.describe(e, f"removing an earlier run's files from run.dir "
                                               f"'{run_dir}'", "run.dir")) from None
        watch.start()
    run.watch = watch
