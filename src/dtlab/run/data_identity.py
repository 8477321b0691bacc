"""What identifies the data a run trains on beyond its config, recorded in each checkpoint's
manifest (owner.record) and compared on resume (owner.check_config): a resume over token files
that `dtlab prepare` rewrote with other text is refused, naming the files that changed."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from dtlab import files


def data_identity(config: dict[str, Any]) -> dict[str, Any] | None:
    """What identifies the data a run trains on beyond its config: the token files' sizes and
    sha256 as `dtlab prepare` recorded them in meta.json (their sizes where it did not). Other
    data sets are named by the config alone (synthetic: its settings; MNIST, CIFAR-10: fixed)."""
    data = config.get("data") or {}
    if data.get("name") != "tokens" or not data.get("dir"):
        return None
    folder = Path(data["dir"])  # `~` expanded by the config (UserPath)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        recorded = meta.get("files") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        recorded = None
    out = {}
    for name in ("train.bin", "val.bin"):
        entry = recorded.get(name) if isinstance(recorded, dict) else None
        if isinstance(entry, dict) and entry.get("sha256"):
            out[name] = {"bytes": entry.get("bytes"), "sha256": entry["sha256"]}
        else:
            with contextlib.suppress(OSError):
                out[name] = {"bytes": (folder / name).stat().st_size}
    return out


def data_changes(saved: Any, now: Any, folder: Path | None = None) -> str:
    """Which token files differ between a checkpoint's data and data.dir's now; '' when none.
    A file recorded with its sha256 that meta.json no longer describes (copied without it, or
    meta.json deleted) is hashed now, so the same bytes are not reported as changed."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return ""
    changed = []
    for name in sorted(saved):
        was, is_ = saved[name], now.get(name)
        if isinstance(was, dict) and isinstance(is_, dict) and "sha256" in was and \
                "sha256" not in is_ and folder is not None and is_.get("bytes") == was.get("bytes"):
            with contextlib.suppress(OSError):
                is_ = {**is_, "sha256": files.file_sha256(folder / name)}
        if isinstance(was, dict) and isinstance(is_, dict) and "sha256" not in was:
            is_ = {k: v for k, v in is_.items() if k != "sha256"}  # recorded by size alone
        if was != is_:
            changed.append(f"{name} ({'sha256' if 'sha256' in was else 'size'})")
    return ", ".join(changed)
