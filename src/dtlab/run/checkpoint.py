"""Sharded checkpoints that survive crashes, and resume that continues exactly.

Layout: RUN_DIR/checkpoints/step_000120/ holds torch.distributed.checkpoint (DCP) shards of the
model and optimizer tensors (each rank writes its own shards; get_state_dict/set_state_dict make
single, DDP, FSDP2 and FSDP1 read and write the same format, so a checkpoint loads on any world
size and strategy), one `rng_rank<r>.json` per rank, and `dtlab-checkpoint.json`, the manifest:
step, config, the run that wrote it (id and config fingerprint: run/owner.py), data-order
parameters, scheduler and scaler state, optimizer hyper-parameters, and the size and sha256 of
every file. (Those names, and which checkpoints are complete, are dtlab/rundir/checkpoints.py's:
the strategies and instruments read them too.)

A save writes into `.tmp-step_000120/`, writes the manifest last, and publishes the directory
with one rename: a directory under the final name is complete; a crash leaves only a `.tmp-`
directory, which is ignored (with a warning) and cleaned up by the next save.

Loading unpickles nothing but tensors: DCP reads tensors with weights_only=True, every non-tensor
value lives in JSON, and DCP's `.metadata` (a pickle) is read by an unpickler that only accepts
DCP's own metadata classes. Checksums are verified before anything is read.
"""

from __future__ import annotations

import base64
import datetime
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from dtlab.run.save_failure import SaveFailure, attempt
from dtlab.rundir.checkpoints import (
    MANIFEST,
    CheckpointError,
    checkpoint_root,
    complete_checkpoints,
)
from dtlab.rundir.hints import start_over

FORMAT = "dtlab-checkpoint/1"


# ------------------------------------------------------------------------------- safe metadata
_ALLOWED = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes and torch's dtype/size constants may be constructed."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


@functools.cache
def _safe_reader() -> type:
    """DCP's FileSystemReader with the metadata read by the allowlisting unpickler. (DCP, and the
    DTensor it imports, load when a checkpoint is first read, not when every run starts.)"""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError("checkpoint metadata is not DCP metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def shard_writer(directory: Path) -> Any:
    """DCP's FileSystemWriter into `directory`, which must exist: it makes no missing parent.
    DCP's own makes them all, so a run directory deleted while a checkpoint is written would
    come back, holding that checkpoint; this write fails instead, and the run says the
    directory was deleted."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ExistingParents(FileSystem):
        def mkdir(self, path: str | os.PathLike) -> None:
            Path(path).mkdir(exist_ok=True)

    writer = FileSystemWriter(str(directory))
    writer.fs = ExistingParents()
    return writer


# ------------------------------------------------------------------------------------ manifest
def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint, after checking that every file is there and unchanged."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' not found; fix: pass a checkpoint directory "
                              "(RUN_DIR/checkpoints/step_NNNNNN), resume=auto or resume=none")
    if not manifest_path.is_file():
        raise CheckpointError(f"'{path}' is not a complete dtlab checkpoint (no {MANIFEST}); "
                              "fix: use a checkpoint written by dtlab train")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError:
        raise CheckpointError(f"{manifest_path} is not valid JSON: the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a {FORMAT} checkpoint")
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is missing {name}; it is incomplete")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint '{path}': {name} has {file.stat().st_size} bytes, the manifest says "
                f"{info['bytes']}: it is truncated or was modified")
        if sha256(file) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint '{path}': {name} fails its sha256 check: it was modified or corrupted")
    return manifest


def _signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in sorted(Path(path).iterdir())
                 if p.is_file() and (st := p.stat()))


_verified: dict[str, tuple[Any, dict[str, Any]]] = {}  # path -> (files' signature, manifest)


def verify(path: Path) -> dict[str, Any]:
    """read_manifest() plus DCP's metadata through the allowlisting unpickler: a checkpoint that
    passes can be loaded (if it matches the model). Remembered while its files stay unchanged, so
    that choosing a checkpoint and loading it hash the files once."""
    path = Path(path)
    key = str(path.resolve())
    if key in _verified and path.is_dir() and _verified[key][0] == _signature(path):
        return _verified[key][1]
    manifest = read_manifest(path)
    try:
        _safe_reader()(str(path)).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint '{path}': refused metadata ({e})") from None
    _verified[key] = (_signature(path), manifest)
    return manifest


def newest_verified(run_dir: Path, warn: bool = True) -> Path | None:
    """resume=auto: the newest complete checkpoint that verifies, None when there is none. The
    newer ones that fail are skipped with one line naming them and why; when every checkpoint
    fails, nothing is resumed silently: CheckpointError."""
    skipped: list[str] = []
    for _, path in reversed(complete_checkpoints(run_dir, warn=warn)):
        try:
            verify(path)
        except CheckpointError as e:
            skipped.append(f"{path.name} ({_reason(e, path)})")
            continue
        if skipped and warn:
            which = "checkpoint" if len(skipped) == 1 else "checkpoints"
            print(f"dtlab: warning: skipped {which} {'; '.join(skipped)}; resuming from "
                  f"{path.name}, the newest that verifies", file=sys.stderr, flush=True)
        return path
    if skipped:
        raise CheckpointError(
            f"no checkpoint in '{checkpoint_root(run_dir)}' verifies: {'; '.join(skipped)}; fix: "
            f"restore a good copy, or {start_over(run_dir)}")
    return None


def own_checkpoints(run_dir: Path, run: dict[str, Any] | None) -> list[Path]:
    """The complete checkpoints of the run `run` (its manifest entry), oldest first, with those
    that record no run (written before runs were recorded): what keep_checkpoints prunes. Another
    run's are never pruned (run_owner refuses to start a run beside them)."""
    mine = (run or {}).get("id")
    own = []
    for _, path in complete_checkpoints(run_dir, warn=False):
        try:
            theirs = (json.loads((path / MANIFEST).read_text()).get("run") or {}).get("id")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: not provably this run's, so not deleted
        if theirs in (None, mine):
            own.append(path)
    return own


def _reason(error: CheckpointError, path: Path) -> str:
    return str(error).replace(f"checkpoint '{path}': ", "").replace(f"checkpoint '{path}' ", "")


# ---------------------------------------------------------------------------------- save/load
def _rng_state(device: torch.device) -> dict[str, str]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def _set_rng_state(state: dict[str, str], device: torch.device) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(tensor(state["cuda"]), device)


def save(run_dir: Path, step: int, tensors: dict[str, Any], manifest: dict[str, Any], ctx: Any,
         keep: int, fault: Any = None, watch: Any = None) -> Path:
    """Write a checkpoint for `step` on every rank, publish it atomically, keep the last `keep`.

    The ranks agree after each phase (prepare, write the shards, publish), so that a failure on
    any rank (a full disk, a read-only mount) stops every rank at the same point with one message,
    and the half-written directory is removed; the previous checkpoint is never touched. `watch`
    (dir_watch.DirectoryWatch): a run directory deleted or replaced meanwhile gets nothing."""
    import torch.distributed.checkpoint as dcp  # here, not at start-up (DCP imports DTensor)

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-{final.name}"
    failure = SaveFailure(run_dir, step, tensors, ctx, watch)

    def prepare() -> None:
        if watch is not None:
            watch.require(step)
        root.mkdir(exist_ok=True)  # not its parents: a run directory gone is not made again
        for stale in root.glob(".tmp-*"):  # an earlier save that was interrupted
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()

    failure.agree(attempt(prepare) if ctx.is_main else None, tmp)

    def write_shards() -> None:
        with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=shard_writer(tmp))
        (tmp / f"rng_rank{ctx.rank}.json").write_text(json.dumps(_rng_state(ctx.device)))

    error = attempt(write_shards, ctx.rank)
    if fault is not None and error is None:
        fault.during_save(step)  # tests: kill -9 here, before anything is published
    failure.agree(error, tmp)

    def publish() -> None:
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        body = {"format": FORMAT, "step": step, "world_size": ctx.world_size, "files": files,
                "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "torch_version": torch.__version__, **manifest}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if watch is not None:
            watch.require(step)
        if final.exists():  # the same step saved again after a restart
            shutil.rmtree(final)
        os.replace(tmp, final)  # the publication: one atomic rename
        for old in own_checkpoints(run_dir, body.get("run"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    failure.agree(attempt(publish) if ctx.is_main else None, tmp)
    return final


def dcp_load(tensors: dict[str, Any], path: Path) -> None:
    """dcp.load with its failures turned into one-line CheckpointErrors (DCP wraps the errors of
    each rank into its own exception type, so they are recognised by their text)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:  # read the metadata ourselves first: DCP would log a refusal with a traceback and retry
        _safe_reader()(str(path)).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}': refused metadata ({e})") from None
    try:
        with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=_safe_reader()(str(path)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be used
        text = str(e)
        refused = re.search(r"[\w.]+ is not allowed in checkpoint metadata", text)
        if refused:
            raise CheckpointError(f"checkpoint '{path}': refused metadata ({refused.group()})") from None
        # DCP's CheckpointException (a BaseException) carries each rank's error and traceback:
        # the error itself is what to say ("Missing key in checkpoint state_dict: ...").
        cause = next(iter(getattr(e, "failures", {}).values()), (e,))[0]
        if not isinstance(cause, Exception):
            raise cause from None  # an interrupt on a rank, as save_failure.attempt lets it through
        text = str(cause)
        first = next((x.strip() for x in text.splitlines() if x.strip()), type(cause).__name__)[:300]
        raise CheckpointError(f"checkpoint '{path}' cannot be loaded into this model: {first}") from None


def load(path: Path, tensors: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Verify, then fill `tensors` in place; returns the manifest. (Whether it belongs to this
    run, its config, is checked before: run_owner.check_config.)"""
    manifest = verify(path)
    dcp_load(tensors, path)
    rng = Path(path) / f"rng_rank{ctx.rank}.json"
    if rng.is_file() and manifest["world_size"] == ctx.world_size:
        _set_rng_state(json.loads(rng.read_text()), ctx.device)
    return manifest
