"""What a run directory may hold and sit beside (docs/reliability.md#what-dtlab-may-delete):
the names of a run's outputs, which a user's files there may not take; no other command's output
around it, above or below; no link in place of the config it writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dtlab import owned
from dtlab.errors import ConfigError
from dtlab.run import dir_lock
from dtlab.run.sweep_record import is_record, launched_by_sweep
from dtlab.rundir.checkpoints import (
    MANIFEST,
    STEP_DIR,
    checkpoint_root,
    complete_checkpoints,
    manifest_json,
)

# What `dtlab train` writes into a run directory; removed when a run starts over there. (Other
# files are left alone: a sweep's config.yaml, run.json and train.log are the sweep's.)
OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.jsonl.tmp", "progress", "summary.json",
           "summary.json.tmp", "model.safetensors", "tb", "trace_rank*.json", "profile", "memory",
           "flight_recorder/*")
# The same, as names directly under run.dir: a user's file there under one of them is refused.
OUTPUT_NAMES = tuple(p.split("/")[0] for p in OUTPUTS)
# A token data set's files (dtlab prepare's, or made by hand): a folder holding them is data.
TOKEN_FILES = ("train.bin", "val.bin")


def run_id_of(manifest: dict[str, Any]) -> str | None:
    """The id of the run that wrote a checkpoint; None for one written before ids were recorded."""
    run = manifest.get("run")
    return run.get("id") if isinstance(run, dict) and isinstance(run.get("id"), str) else None


def check_owned(cfg: Any, config: str | None = None) -> None:
    """run.dir holds nothing a run would replace that no dtlab run wrote: another command's
    output, or the user's own files under the names of a run's outputs. The run writes its
    resolved config to config.yaml: one there is refused too, unless it is the file the run is
    configured from (a sweep's run, or a run started again from its own config.yaml)."""
    run_dir = cfg.run.run_dir
    owned.check_own_directory(Path(run_dir), "run.dir")
    check_not_inside(Path(run_dir))
    below = owned.output_below(Path(run_dir))
    if below is not None:
        what = "a run" if below[1]["kind"] == "run" else f"the output of dtlab {below[1]['kind']}"
        raise ConfigError(f"run.dir '{run_dir}' holds {what} in '{below[0]}', which this run's "
                          "files would sit among and be collected and reported with; fix: a "
                          "run.dir of its own beside it")
    tokens = [n for n in TOKEN_FILES if (Path(run_dir) / n).exists()]
    if tokens:
        raise ConfigError(f"run.dir '{run_dir}' is a token data set ({', '.join(tokens)}), whose "
                          "folder dtlab prepare replaces whole and whose files the run's would sit "
                          "among; fix: a run.dir of its own (e.g. runs/NAME), with data.dir naming "
                          "that folder")
    link = Path(run_dir) / "config.yaml"
    if link.is_symlink():
        raise ConfigError(f"run.dir '{run_dir}' holds config.yaml as a link to "
                          f"'{os.readlink(link)}', which the run would replace with a file of its "
                          "resolved config; fix: remove the link (--config can name the file "
                          "itself), or choose another run.dir")
    foreign = foreign_in_checkpoints(Path(run_dir))
    if foreign:
        them = "it" if len(foreign) == 1 else "them"
        raise ConfigError(f"run.dir '{run_dir}' holds {owned.shown(foreign)}, which dtlab did not "
                          f"write and prunes or replaces with its checkpoints; fix: move {them} "
                          "out of checkpoints/")
    record = owned.read(run_dir)
    if record is not None and record["kind"] != "run":
        raise ConfigError(f"run.dir '{run_dir}' holds the output of dtlab {record['kind']}, not a "
                          "run; fix: choose another run.dir (a new folder inside it will do)")
    if record is not None or _earlier_dtlab_run(run_dir) or cfg.run.overwrite:
        return
    own_config = config is not None and \
        Path(config).resolve() == (Path(run_dir) / "config.yaml").resolve()
    foreign = owned.unrecorded(run_dir, OUTPUT_NAMES + (() if own_config else ("config.yaml",)),
                               None) + ([] if is_record(Path(run_dir)) else ["run.json"])
    if foreign:
        them = "it" if len(foreign) == 1 else "them"
        raise ConfigError(f"run.dir '{run_dir}' holds {owned.shown(foreign)}, which no dtlab run "
                          f"recorded writing there and a run would replace; fix: move {them} away, "
                          f"run.overwrite=true to delete {them}, or choose another run.dir")


def check_not_inside(run_dir: Path) -> None:
    """run.dir is not inside another dtlab output, which its owner may replace or prune (a run's
    checkpoints, a compare's or sweep's folders), except where that owner put this run: a
    compare's strategy directory it recorded, a sweep's run directory it planned (run.json)."""
    for path in {Path(os.path.abspath(run_dir)), Path(os.path.realpath(run_dir))}:  # links too
        _check_not_inside(run_dir, path)


def _check_not_inside(run_dir: Path, path: Path) -> None:
    found = owned.enclosing(path)
    for above in path.parents:  # a checkpoint lies inside its run: said first, as the nearer
        if (above / MANIFEST).is_file():
            raise ConfigError(f"run.dir '{run_dir}' is inside the checkpoint '{above}', which its "
                              "run prunes and replaces; fix: a run.dir outside it")
        if found is not None and above == found[0]:
            break
    if found is None:
        return
    above, record = found
    kind = record["kind"]
    if kind == "compare" and path.parent == above and path.name in record["entries"] and \
            not dir_lock.in_use(above):  # while no compare runs there: its table describes it
        raise ConfigError(f"run.dir '{run_dir}' is a run of dtlab compare '{above}', whose table "
                          "describes it; fix: run that compare again to retrain it, or a run.dir "
                          "outside it")
    sweeps = kind == "sweep" and path.parent == above / "runs" and (path / "run.json").is_file()
    if sweeps and not launched_by_sweep(path):  # by hand, from its config.yaml for instance
        raise ConfigError(f"run.dir '{run_dir}' is a run of dtlab sweep '{above}', whose results "
                          "describe it; fix: run that sweep again to continue it, or a run.dir "
                          "outside it")
    planned = (kind == "compare" and path.parent == above and path.name in record["entries"]) \
        or sweeps
    if not planned:
        what = "the run directory" if kind == "run" else f"the output of dtlab {kind}"
        raise ConfigError(f"run.dir '{run_dir}' is inside {what} '{above}', whose files that "
                          f"{kind} may replace or delete; fix: a run.dir outside it")


def _earlier_dtlab_run(run_dir: Path) -> bool:
    """Checkpoints a dtlab run wrote before runs kept a record: their manifests name the run."""
    return any(run_id_of(manifest_json(p) or {}) for _, p in complete_checkpoints(run_dir, False))


def foreign_in_checkpoints(run_dir: Path) -> list[str]:
    """Files in run.dir's checkpoints/ that no checkpoint of dtlab's names (a user's notes there,
    an evaluation beside a checkpoint's shards), as paths from run.dir: pruning and starting over
    would delete them with the checkpoints."""
    root = checkpoint_root(run_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".tmp-"):  # a save in progress, or cut short: dtlab's
            continue
        manifest = manifest_json(entry) if STEP_DIR.match(entry.name) and entry.is_dir() else None
        if manifest is None or not isinstance(manifest.get("files"), dict):
            if not (STEP_DIR.match(entry.name) and entry.is_dir()):
                found.append(f"checkpoints/{entry.name}")
            continue
        ours = {*manifest["files"], MANIFEST}
        found += [f"checkpoints/{entry.name}/{p.name}" for p in sorted(entry.iterdir())
                  if p.name not in ours]
    return found
