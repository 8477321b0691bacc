"""ZeRO-Infinity on one rank: DeepSpeed's offload of parameters and optimizer state to files.

DeepSpeed writes them under <nvme_path>/zero_stage_3/ (<dtype>params/rank<r>/ and
optimizer/rank<r>/), removes its own folder when a run starts again, and never at the end: dtlab
measures this rank's files (summary.json's disk_bytes) and removes them when its engine is
destroyed, and the nvme_path directory itself when it is dtlab's (the default, <run.dir>/nvme).
The checks before launch are in dtlab.config.strategies.deepspeed_aio.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.config.strategies.deepspeed_aio import swap_dirs
from dtlab.config.strategies.deepspeed_config import NVME_PARAM_BUFFERS, nvme_offloads
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config


def rank_swap_folders(ds: dict[str, Any], rank: int) -> list[Path]:
    """This rank's swap folders (DeepSpeed's layout, 0.19.8: swap_tensor/*_swapper.py)."""
    out = []
    for path in swap_dirs(ds):
        root = path / "zero_stage_3"
        if root.is_dir():
            out += [d for d in root.glob(f"*/rank{rank}") if d.is_dir()]
    return out


def swap_bytes(ds: dict[str, Any], rank: int) -> int:
    """Bytes of this rank's swap files on disk now."""
    return sum(f.stat().st_size for d in rank_swap_folders(ds, rank) for f in d.rglob("*")
               if f.is_file())


def remove_swap_files(ds: dict[str, Any], rank: int, default_dir: Path | None) -> None:
    """Remove this rank's swap folders, and default_dir (dtlab's own nvme_path) once empty."""
    for folder in rank_swap_folders(ds, rank):
        shutil.rmtree(folder, ignore_errors=True)
    if default_dir is not None:
        for path in sorted(default_dir.rglob("*"), reverse=True) + [default_dir]:
            with contextlib.suppress(OSError):
                path.rmdir()  # empty folders only: another rank's files stay until it is done


class Swap:
    """One rank's NVMe offload: where its swap files go, their bytes, their removal."""

    def __init__(self, cfg: Config, ds: dict[str, Any], rank: int) -> None:
        self.ds, self.rank = ds, rank
        default = cfg.run.run_dir / "nvme"
        self.own_dir = default if default in swap_dirs(ds) else None  # dtlab's: removed at the end

    @classmethod
    def of(cls, cfg: Config, ds: dict[str, Any], rank: int) -> Swap | None:
        return cls(cfg, ds, rank) if nvme_offloads(ds) else None

    def fit_buffers(self, model: Any, world: int) -> None:
        """A parameter's partition must fit one swap buffer (DeepSpeed asserts so mid-run):
        dtlab's default buffer_size grows to the largest partition; a JSON's value is refused."""
        section = self.ds["zero_optimization"].get("offload_param") or {}
        if section.get("device") != "nvme":
            return
        largest = max((-(-p.numel() // world) for p in model.parameters()), default=0)
        if largest > section["buffer_size"]:
            if section.get("buffer_size") != NVME_PARAM_BUFFERS["buffer_size"]:
                raise ConfigError(
                    f"zero_optimization.offload_param.buffer_size={section['buffer_size']} is "
                    f"smaller than the largest parameter partition ({largest} elements); fix: "
                    f"set it to {largest} or more, or remove it (dtlab then sizes it)")
            section["buffer_size"] = largest

    def bytes(self) -> int:
        return swap_bytes(self.ds, self.rank)

    def remove(self) -> None:
        remove_swap_files(self.ds, self.rank, self.own_dir)
