"""What identifies the data a run trains on beyond its config, recorded in each checkpoint's
manifest (owner.record) and compared on resume (owner.check_config): a resume over token files
that changed since (`dtlab prepare` run again on other text, or files made elsewhere rewritten)
is refused, naming the files that changed."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from dtlab import files

WHOLE = 256 << 20  # token files up to this size are hashed whole where no meta.json did it
SAMPLES, SAMPLE = 16, 1 << 20  # larger ones: this many evenly spread pieces of this size
_known: dict[tuple[str, int, int, str], str] = {}  # (path, size, mtime, kind) -> digest


def _digest(path: Path, kind: str) -> str:
    """sha256 of the whole file ("sha256"), or of its size and SAMPLES pieces ("sha256_sampled"),
    computed once per file version in this process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, kind)
    if key not in _known:
        if kind == "sha256":
            _known[key] = files.file_sha256(path)
        else:
            h = hashlib.sha256(str(st.st_size).encode())
            with open(path, "rb") as f:
                for i in range(SAMPLES):
                    f.seek(i * max(0, st.st_size - SAMPLE) // (SAMPLES - 1))
                    h.update(f.read(SAMPLE))
            _known[key] = h.hexdigest()
    return _known[key]


def data_identity(config: dict[str, Any]) -> dict[str, Any] | None:
    """What identifies the data a run trains on beyond its config: the token files' sizes and
    sha256 as `dtlab prepare` recorded them in meta.json, else computed here (whole up to
    WHOLE bytes, sampled above). Other data sets are named by the config alone (synthetic: its
    settings; MNIST, CIFAR-10: fixed)."""
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
            continue
        with contextlib.suppress(OSError):
            size = (folder / name).stat().st_size
            kind = "sha256" if size <= WHOLE else "sha256_sampled"
            out[name] = {"bytes": size, kind: _digest(folder / name, kind)}
    return out


def data_changes(saved: Any, now: Any, folder: Path | None = None) -> str:
    """Which token files differ between a checkpoint's data and data.dir's now; '' when none.
    A digest the checkpoint recorded that `now` lacks (meta.json deleted or added since) is
    computed from the file now, so the same bytes are not reported as changed."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return ""
    changed = []
    for name in sorted(saved):
        was, is_ = saved[name], now.get(name)
        if isinstance(was, dict) and isinstance(is_, dict):
            is_ = dict(is_)
            for kind in ("sha256", "sha256_sampled"):
                if kind in was and kind not in is_ and folder is not None and \
                        is_.get("bytes") == was.get("bytes"):
                    with contextlib.suppress(OSError):
                        is_[kind] = _digest(folder / name, kind)
            is_ = {k: v for k, v in is_.items() if k in was}  # what the checkpoint recorded
        if was != is_:
            how = "sha256" if isinstance(was, dict) and len(was) > 1 else "size"
            changed.append(f"{name} ({how})")
    return ", ".join(changed)
