"""Where a run's checkpoints live and which are complete: RUN_DIR/checkpoints/step_NNNNNN/, each
published with its manifest written last (dtlab/run/checkpoint.py writes, verifies and loads them).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError

MANIFEST = "dtlab-checkpoint.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(DtlabError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, tampered or mismatched."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path, warn: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint, oldest first."""
    root = checkpoint_root(run_dir)
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = STEP_DIR.match(path.name)
        if m and (path / MANIFEST).is_file():
            found.append((int(m.group(1)), path))
        elif warn and path.name.startswith(".tmp-"):
            print(f"dtlab: warning: ignoring incomplete checkpoint {path} (a save was interrupted)",
                  file=sys.stderr)
        elif warn and path.name.startswith("step_"):  # a save publishes its manifest with it
            print(f"dtlab: warning: ignoring checkpoint {path}: it has no {MANIFEST} (emptied or "
                  "changed outside dtlab)", file=sys.stderr)
    return sorted(found)


def manifest_json(path: Path) -> dict[str, Any] | None:
    """A checkpoint's manifest as JSON (not verified: resume does that), None if unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None
