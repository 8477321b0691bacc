"""A sweep's earlier runs, found again by what they ran.

A run's directory is named by the hash of its resolved config (spec.config_key). A key that dtlab
adds to its config, at its default, changes every hash: the runs a sweep finished before would
look unfinished and run again beside themselves. So each earlier run is recognised by its own
config.yaml, loaded as dtlab reads configs now; a run of a config this spec no longer makes (its
base config edited since, or a default dtlab changed) is refused rather than mixed into results
with the new ones.
"""

from __future__ import annotations

from pathlib import Path

from dtlab.config import load_config
from dtlab.errors import ConfigError, DtlabError
from dtlab.owned import shown
from dtlab.run.sweep_record import read_record
from dtlab.sweeps.spec import PlannedRun, config_key


def key_now(run_dir: Path) -> str | None:
    """The key of the run in `run_dir` as dtlab computes keys today; None when it has no readable
    config or record (not a run this sweep planned)."""
    record = read_record(run_dir)
    config = run_dir / "config.yaml"
    if not isinstance(record, dict) or not config.is_file():
        return None
    try:
        cfg = load_config(config)
        return config_key(cfg, int(record["nproc_per_node"]), int(record["nnodes"]),
                          str(record["slurm_mode"]))
    except (DtlabError, KeyError, TypeError, ValueError):
        return None


def match(plans: list[PlannedRun], out_dir: Path) -> None:
    """Point each planned run at the directory of its earlier run, under whatever name; refuse
    (one line, nothing written) when runs/ holds runs no combination of this spec makes."""
    runs = Path(out_dir) / "runs"
    if not runs.is_dir():
        return
    planned = {p.key: p for p in plans if not p.invalid}
    names = {p.run_dir.name for p in planned.values()}
    stale = []
    for d in sorted(runs.iterdir()):
        if not d.is_dir() or d.name in names:
            continue
        key = key_now(d)
        plan = planned.get(key) if key else None
        if plan is not None and not plan.run_dir.exists():
            plan.run_dir = d
            plan.config.run.dir = str(d)
        else:
            stale.append(f"runs/{d.name}")
    if stale:
        them = "it" if len(stale) == 1 else "them"
        raise ConfigError(
            f"{out_dir} holds {shown(stale)}, which no combination of this sweep makes now (its "
            f"base config, or a default of dtlab, changed since {them}): the results would mix "
            f"{them} with the new runs; fix: --out a new directory, or move {them} away")
