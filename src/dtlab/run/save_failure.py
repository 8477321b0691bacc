"""When a checkpoint save fails (a full disk, a file-size limit, a read-only mount): every rank
stops at the same point, the half-written directory is removed, and rank 0 says in one line what
happened, what the checkpoint needed, and which checkpoint a rerun continues from."""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from dtlab import files
from dtlab.errors import PeerError, RunError
from dtlab.run.dir_watch import RunDirGone
from dtlab.rundir.checkpoints import checkpoint_root, complete_checkpoints
from dtlab.rundir.hints import intact_note

GONE_GRACE_S = 2.0


def attempt(fn: Any, rank: int = 0) -> BaseException | None:
    """fn()'s failure on this rank, or None. Interrupts pass through, also when DCP wrapped them."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any failure of a save is reported the same way
        return e
    except CheckpointException as e:
        # Every rank gets the failures of all ranks; this rank reports only its own.
        own = e.failures[rank][0] if rank in e.failures else None
        if own is not None and not isinstance(own, Exception):
            raise own from None  # an interrupt (KeyboardInterrupt, SystemExit) on this rank
        return own if own is not None or e.failures else e
    return None


class SaveFailure:
    """Turns a failed save into one line, printed by rank 0 (every rank stops)."""

    def __init__(self, run_dir: Path, step: int, tensors: dict[str, Any], ctx: Any,
                 watch: Any = None) -> None:
        self.run_dir, self.step, self.ctx, self.watch = Path(run_dir), step, ctx, watch
        self.tensors = tensors
        self.free_before = files.free_bytes(checkpoint_root(run_dir))

    def agree(self, error: BaseException | None, tmp: Path) -> None:
        """Collective: raise on every rank when any rank failed."""
        text = self.explain(error) if error is not None else None
        texts = _all_gather_text(self.ctx, text)
        failed = [(r, t) for r, t in enumerate(texts) if t is not None]
        if not failed:
            return
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed save took
        rank, message = failed[0]
        if self.ctx.is_main:
            raise RunError(message)
        peer = PeerError(f"rank {rank} could not write checkpoint step {self.step}")
        peer.exit_code = 1
        raise peer

    def explain(self, error: BaseException) -> str:
        if isinstance(error, RunDirGone):  # it says all
            return str(error)
        os_error = files.os_error_in(error)
        gone = self._gone(os_error)
        if gone:  # deleted or replaced while the checkpoint was written
            self.watch.lost = True
            return self.watch.line(self.step, gone)
        root = checkpoint_root(self.run_dir)
        part = f"rank {self.ctx.rank}'s part of " if self.ctx.world_size > 1 else ""
        doing = f"writing {part}checkpoint step {self.step} to '{root}'"
        needed = self.needed_bytes()
        free, limit = self.free_before, files.file_size_limit()
        if os_error is None:
            # torch.save reports a failed write as "unexpected pos N vs M", without the errno:
            # the file-size limit and the free space tell what it was.
            if limit is not None and limit < needed:
                os_error = OSError(errno.EFBIG, "File too large")
            elif (free_now := files.free_bytes(root)) is not None and free_now < needed:
                os_error = OSError(errno.ENOSPC, "No space left on device")
        intact = intact_note(self.run_dir)
        if os_error is None:
            first = next((x.strip() for x in str(error).splitlines() if x.strip()),
                         type(error).__name__)[:200]
            return f"{doing} failed ({first}); {intact}; fix: check the file system holding run.dir"
        need = ""
        if os_error.errno in files.FULL:
            need = f" (needs ~{needed / files.MB:.1f} MB" + (
                f", {free / files.MB:.1f} MB free)" if free is not None else ")")
        elif os_error.errno == errno.EFBIG and limit is not None:
            need = f" (needs ~{needed / files.MB:.1f} MB, file-size limit {limit / files.MB:.1f} MB)"
        return (f"{files.cause(os_error)} while {doing}{need}; {intact}; "
                f"fix: {files.fix(os_error, 'run.dir')}")

    def _gone(self, os_error: OSError | None) -> str | None:
        """How the run directory went, if it did. A file missing under it mid-save is most
        often a deletion of the whole directory still under way (rmtree empties it first): that
        is given GONE_GRACE_S to finish before the save's own error is reported."""
        if self.watch is None:
            return None
        deadline = time.monotonic() + (GONE_GRACE_S if isinstance(os_error, FileNotFoundError)
                                       else 0.0)
        while (gone := self.watch.problem()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return gone

    def needed_bytes(self) -> int:
        """What the checkpoint takes: the previous one's size, else this rank's tensors times the
        ranks (an upper bound: replicated tensors are written once)."""
        found = complete_checkpoints(self.run_dir, warn=False)
        if found:
            return files.tree_bytes(found[-1][1])
        local = sum(t.numel() * t.element_size() for t in _tensors(self.tensors))
        return local * self.ctx.world_size


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    if torch.is_tensor(tree):
        return [tree.to_local() if hasattr(tree, "to_local") else tree]
    return []


def _all_gather_text(ctx: Any, text: str | None) -> list[str | None]:
    if ctx.backend is None or ctx.world_size == 1:
        return [text]
    import torch.distributed as dist

    out: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(out, text)
    return out
