"""ZeRO-Infinity: DeepSpeed's offload of parameters and optimizer state to files on an NVMe disk.

What dtlab checks before any rank starts (`check`, the deepspeed spec's environment check):
the swap directory can be written with O_DIRECT (DeepSpeed's async_io opens its files so; tmpfs
refuses it), and DeepSpeed's async_io op loads (it needs libaio, and is built by JIT on first use,
~3 min on 2 cores, cached under TORCH_EXTENSIONS_DIR). What a run measures (`swap_bytes`): the
bytes of this rank's swap files. DeepSpeed writes them under <nvme_path>/zero_stage_3/
(<dtype>params/rank<r>/ and optimizer/rank<r>/), removes its own folder when a run starts again,
and never at the end: dtlab removes a rank's folders when its engine is destroyed, and the
nvme_path directory itself when dtlab created it (the default, <run.dir>/nvme).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.cpp_extension import _get_build_directory

from dtlab import files
from dtlab.config.strategies.deepspeed_config import (
    NVME_PARAM_BUFFERS,
    deepspeed_config,
    nvme_offloads,
)
from dtlab.errors import ConfigError, DtlabError

if TYPE_CHECKING:
    from dtlab.config import Config

FIX = ("fix: install libaio (Debian/Ubuntu: apt-get install libaio-dev; RHEL: yum install "
       "libaio-devel; the first run then builds the op, about 3 min on 2 cores, cached), or "
       "offload to host memory instead (strategy.deepspeed.offload_device=cpu)")
BUILD_NOTE = ("dtlab: building DeepSpeed's async_io op for NVMe offload (once: about 3 min on 2 "
              "cores; cached in {where})")


def _aio_builder() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the strategy does on a host-only run
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("AsyncIOBuilder")


def aio_status() -> tuple[str, str]:
    """(state, what was found) of DeepSpeed's async_io op, without building it. States:
    "no-deepspeed", "no-libaio", "unbuilt" (libaio found, the first use builds it), "built"."""
    if importlib.util.find_spec("deepspeed") is None:
        return "no-deepspeed", "the deepspeed package is not installed"
    builder = _aio_builder()
    if builder is None or not builder.is_compatible(verbose=False):
        return "no-libaio", "libaio (its headers and library) was not found"
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("async_io"):
        return "built", "libaio found; async_io op installed with deepspeed"
    where = Path(_get_build_directory(builder.name, verbose=False))
    if (where / f"{builder.name}.so").is_file():
        return "built", f"libaio found; async_io op built in {where}"
    return "unbuilt", f"libaio found; the first NVMe run builds the async_io op in {where}"


def aio_problem() -> str | None:
    """Why DeepSpeed's async_io op cannot load here (None: it loads; built first if need be)."""
    state, found = aio_status()
    if state in ("no-deepspeed", "no-libaio"):
        return found
    if state == "unbuilt":
        print(BUILD_NOTE.format(where=found.rsplit(" in ", 1)[-1]), file=sys.stderr, flush=True)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            _aio_builder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - a compiler or loader failure, said in one line
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"building or loading it failed ({type(e).__name__}: {first})"
    return None


def check_aio() -> None:
    problem = aio_problem()
    if problem:
        raise ConfigError(f"offload to nvme needs DeepSpeed's async_io op, which cannot load: "
                          f"{problem}; {FIX}")


def swap_dirs(ds: dict[str, Any]) -> list[Path]:
    """The directories a run's NVMe offload writes into (one or two nvme_path values)."""
    zero = ds["zero_optimization"]
    return sorted({Path(zero[k]["nvme_path"]) for k in nvme_offloads(ds)})


def check_direct_io(path: Path, key: str) -> None:
    """A file in `path` (or the nearest existing parent) opens with O_DIRECT, as async_io's do."""
    files.check_writable_dir(path, key)
    existing = next(p for p in (path, *path.parents) if p.exists())
    fd, name = tempfile.mkstemp(dir=existing, prefix=".dtlab-direct-io-")
    os.close(fd)
    try:
        os.close(os.open(name, os.O_RDWR | getattr(os, "O_DIRECT", 0)))
    except OSError as e:
        raise ConfigError(f"{key} '{path}' is on a file system that refuses direct I/O "
                          f"({e.strerror}; tmpfs does), which DeepSpeed's NVMe offload uses; fix: "
                          "point it at a directory on a disk (ext4, xfs)") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def check(cfg: Config) -> None:
    """Before any rank starts: a run that offloads to nvme can write its swap files and load
    DeepSpeed's async_io op."""
    if cfg.strategy.deepspeed.offload_device != "nvme" and not _json_offloads_nvme(cfg):
        return
    ds = deepspeed_config(cfg, 1)
    for path in swap_dirs(ds):
        check_direct_io(path, "strategy.deepspeed.nvme_path")
    check_aio()


def _json_offloads_nvme(cfg: Config) -> bool:
    if not cfg.strategy.deepspeed.config:
        return False
    try:
        return bool(nvme_offloads(deepspeed_config(cfg, 1)))
    except DtlabError:
        return False  # the config's own error is said by the config check


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
        for path in swap_dirs(ds):
            path.mkdir(parents=True, exist_ok=True)

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
