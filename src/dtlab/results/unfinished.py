"""What a run that wrote no summary.json (interrupted, or failed) says of itself elsewhere, for
`dtlab collect`: its run.json holds only how it ended.

- the strategy: config.yaml, the resolved config rank 0 writes when the run starts (again on
  every resume, so it is the last attempt's);
- the world size: 1 for a one-process strategy; else the newer of the last checkpoint's manifest
  (its `world_size`) and the ranks' flight-recorder dumps, which each rank writes when a signal
  or a failure stops it (`dtlab.world_size`). The newer, because a resume on another number of
  ranks leaves the older one behind. Neither there: unknown (blank), never a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dtlab.config.strategies import registry
from dtlab.rundir.checkpoints import MANIFEST, complete_checkpoints, manifest_json

FLIGHT_RECORDER = "flight_recorder"  # dtlab/instruments/flight_recorder.py's DIR


def unfinished_run(run_dir: Path) -> dict[str, Any]:
    """{"strategy": label, "world_size": n} as far as the run's files tell (keys left out
    where they do not)."""
    found: dict[str, Any] = {}
    strategy = _strategy(run_dir / "config.yaml")
    if strategy is None:
        return found
    name, options = strategy
    found["strategy"] = registry.label({"strategy": name, "strategy_options": options})
    spec = registry.SPECS.get(name)
    if spec is not None and spec.one_process:
        found["world_size"] = 1
        return found
    sizes = [*_checkpoint_world(run_dir), *_dumped_world(run_dir)]
    if sizes:
        found["world_size"] = max(sizes)[1]
    return found


def _strategy(path: Path) -> tuple[str, dict[str, Any]] | None:
    """(strategy.name, its options section) of a resolved config; None when unreadable."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    section = config.get("strategy") if isinstance(config, dict) else None
    name = section.get("name") if isinstance(section, dict) else None
    if not isinstance(name, str):
        return None
    options = section.get(name)
    return name, options if isinstance(options, dict) else {}


def _checkpoint_world(run_dir: Path) -> list[tuple[float, int]]:
    """(when written, world size) of the last complete checkpoint, if any."""
    found = complete_checkpoints(run_dir, warn=False)
    if not found:
        return []
    path = found[-1][1]
    size = (manifest_json(path) or {}).get("world_size")
    return _dated(path / MANIFEST, size)


def _dumped_world(run_dir: Path) -> list[tuple[float, int]]:
    """(when written, world size) of each rank's flight-recorder dump."""
    out = []
    for path in sorted((run_dir / FLIGHT_RECORDER).glob("rank*.json")):
        try:
            dump = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        about = dump.get("dtlab") if isinstance(dump, dict) else None
        out += _dated(path, about.get("world_size") if isinstance(about, dict) else None)
    return out


def _dated(path: Path, size: Any) -> list[tuple[float, int]]:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return []
    try:
        return [(path.stat().st_mtime, size)]
    except OSError:
        return []
