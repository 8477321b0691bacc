"""What a sweep knows about each run: `run.json` in its directory, written atomically."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from dtlab import files

# Set by a sweep for the runs it launches (locally, and in its SLURM job scripts): the run
# directory it planned. A run in a sweep's folders without it is someone else's, replacing the
# sweep's run behind its results (run/neighbours.py).
SWEEP_RUN_VAR = "DTLAB_SWEEP_RUN"


def launched_by_sweep(run_dir: Path) -> bool:
    return os.environ.get(SWEEP_RUN_VAR) == os.path.realpath(run_dir)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_record(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / "run.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_record(run_dir: Path) -> bool:
    """run.json is absent or dtlab's record (a mapping with a status), not a user's file."""
    path = Path(run_dir) / "run.json"
    if not os.path.lexists(path):
        return True
    record = read_record(run_dir)  # written when a sweep planned the run, or a run stopped
    return isinstance(record, dict) and isinstance(record.get("status"), str) and \
        ("planned_at" in record or "finished_at" in record)


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    files.replace_whole(run_dir / "run.json",
                        lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))


def update_record(run_dir: Path, **changes: Any) -> dict[str, Any]:
    record = {**(read_record(run_dir) or {}), **changes}
    write_record(run_dir, record)
    return record


def is_done(run_dir: Path) -> bool:
    """Finished successfully before: recorded as done and its summary is there."""
    record = read_record(run_dir)
    return bool(record and record.get("status") == "done" and (Path(run_dir) / "summary.json").is_file())


def failure_reason(log: Path, returncode: int | None, since: int = 0) -> str:
    """The most telling line of a failed run's log from byte `since` on (this attempt's part
    of a log that keeps the earlier ones), and how it ended."""
    lines: list[str] = []
    if Path(log).is_file():
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith(("dtlab: error:", "dtlab: interrupted"))]
    tail = [x for x in lines if not x.startswith("[METRIC]")]
    detail = errors[-1] if errors else (tail[-1] if tail else "no output")
    ending = f"exit code {returncode}" if returncode is not None else "no exit code"
    return f"{ending}: {detail[:300]}"
