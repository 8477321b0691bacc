"""Experiment trackers (`run.trackers`): what rank 0 writes to metrics.jsonl and summary.json, also
sent to TensorBoard, MLflow or Weights & Biases.

Each tracker gets, in order: the resolved config as parameters (dotted keys), every logged
record (training steps and evaluations) as metrics at its step, the summary, the run directory's
files as artifacts, and the end of the run (finished or failed). A tracker's package is imported
only when it is listed; a missing one is refused before any rank starts (config/world.py).

A tracker is a guest of the run: one that fails while training (a server gone, a full disk)
prints one warning line and is dropped; training goes on. Failing to start is different: the
user asked for it and nothing has been logged yet, so the run stops there with one line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtlab import files
from dtlab.config.load import flatten
from dtlab.errors import DtlabError

if TYPE_CHECKING:
    from dtlab.config import Config

# The run directory's files attached at the end, where present (checkpoints are left out: they
# are large and already on disk beside the run).
ARTIFACTS = ("config.yaml", "summary.json", "metrics.jsonl", "stop.json", "report.html",
             "plots", "profile", "memory")
IDS_FILE = "trackers.json"  # each tracker's run id, so that a resumed run continues the same run


class Tracker(Protocol):
    """Made as Kind(run.<name> options, run_dir, run id to go on in or None)."""

    name: str
    settings: str  # what decides where it logs: named by the line of one that cannot start
    run_id: str

    def params(self, params: dict[str, str]) -> None: ...
    def metrics(self, values: dict[str, float], step: int) -> None: ...
    def summary(self, values: dict[str, float | str], step: int) -> None: ...
    def artifacts(self, run_dir: Path, paths: list[Path]) -> None: ...
    def end(self, finished: bool) -> None: ...


def as_param(value: Any) -> str:
    """A config value as the text trackers store (lists and None as JSON, like the YAML)."""
    return value if isinstance(value, str) else json.dumps(value)


def numbers(record: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, float]:
    """The record's numeric values (booleans are flags, not metrics)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip}


class Trackers:
    """The run's trackers behind one set of calls; each call reaches every tracker still on."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.on = list(trackers)
        self.step = 0

    def _each(self, what: str, call: Any) -> None:
        for t in list(self.on):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - any failure of a guest: warn once, drop it
                self.on.remove(t)
                with contextlib.suppress(Exception):  # its run marked failed, where it still can be
                    t.end(False)
                print(f"dtlab: warning: tracker {t.name} failed {what} at step {self.step} "
                      f"({reason(e)}); the run goes on without it "
                      "(metrics.jsonl and summary.json have everything)", file=sys.stderr,
                      flush=True)

    def metrics(self, record: dict[str, Any]) -> None:
        self.step = int(record.get("step", self.step))
        values = numbers(record, skip=("step",))
        if values:
            self._each("logging metrics", lambda t: t.metrics(values, self.step))

    def summary(self, summary: dict[str, Any]) -> None:
        flat = {k: v for k, v in flatten(summary).items()
                if isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool))}
        step = int(summary.get("steps", self.step) or 0)
        self._each("logging the summary", lambda t: t.summary(flat, step))

    def end(self, run_dir: Path, finished: bool) -> None:
        found = [run_dir / name for name in ARTIFACTS if (run_dir / name).exists()]
        self._each("attaching the run's files", lambda t: t.artifacts(run_dir, found))
        self._each("ending its run", lambda t: t.end(finished))
        self.on = []


def reason(error: Exception, most: int = 200) -> str:
    """An exception as part of one line: its first line, at most `most` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= most else text[:most].rstrip() + "..."


def open_trackers(cfg: Config, run_dir: Path, resumed: bool) -> Trackers:
    """Start each tracker of run.trackers on rank 0 and log the resolved config into it."""
    names = cfg.run.active_trackers
    if not names:
        return Trackers([])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtlabError(files.describe(e, f"writing into run.dir '{run_dir}'", "run.dir")) from None
    ids = _saved_ids(run_dir) if resumed else {}
    params = {k: as_param(v) for k, v in flatten(cfg.model_dump(mode="json")).items()}
    started: list[Tracker] = []
    for name in names:
        kind = _kind(name)
        try:
            tracker = kind(getattr(cfg.run, name), run_dir, ids.get(name))
            tracker.params(params)
        except Exception as e:
            for t in started:
                t.end(False)
            raise DtlabError(f"tracker {name} could not start ({reason(e)}); fix: check "
                             f"{kind.settings} (docs/observability.md#experiment-trackers), or "
                             f"remove {name} from run.trackers") from None
        started.append(tracker)
    ids.update({t.name: t.run_id for t in started if t.run_id})
    files.write_text(run_dir / IDS_FILE, json.dumps(ids, indent=2) + "\n", "run.dir")
    return Trackers(started)


def _kind(name: str) -> Any:
    """The tracker class of a run.trackers entry (its module imports its package when used)."""
    if name == "mlflow":
        from dtlab.instruments.trackers.mlflow import MlflowTracker

        return MlflowTracker
    if name == "wandb":
        from dtlab.instruments.trackers.wandb import WandbTracker

        return WandbTracker
    from dtlab.instruments.trackers.tensorboard import TensorBoardTracker

    return TensorBoardTracker


def _saved_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}
