"""Before any rank starts, a run that offloads to NVMe (ZeRO-Infinity): its swap directory can be
written with O_DIRECT (DeepSpeed's async_io opens its files so; tmpfs before Linux 6.6 refuses it)
and DeepSpeed's async_io op loads (it links against libaio and is built by JIT on first use, ~1.5
min on 2 cores, cached under TORCH_EXTENSIONS_DIR). `dtlab doctor` reports the op's state.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab import files
from dtlab.config.device import device_type
from dtlab.config.strategies.deepspeed_config import deepspeed_config, nvme_offloads
from dtlab.errors import ConfigError, DtlabError

if TYPE_CHECKING:
    from dtlab.config import Config

FIX = ("fix: install libaio (Debian/Ubuntu: apt-get install libaio-dev; RHEL: yum install "
       "libaio-devel; the first run then builds the op, about 1.5 min on 2 cores, cached), or "
       "offload to host memory instead (strategy.deepspeed.offload_device=cpu)")
BUILD_NOTE = ("dtlab: building DeepSpeed's async_io op for NVMe offload (once: about 1.5 min on 2 "
              "cores; cached in {where})")


def _aio_builder() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the strategy does on a host-only run
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    # Without debug info: a fifth less compiler time (each of its 12 files parses torch's
    # headers: 19 s with -g, 15 s without, here), and nothing of ours to debug in it.
    flags = builder.cxx_args
    builder.cxx_args = lambda: [f for f in flags() if f != "-g"]
    return builder


def aio_status() -> tuple[str, str]:
    """(state, what was found) of DeepSpeed's async_io op, without building it. States:
    "no-deepspeed", "no-libaio", "unbuilt" (libaio found, the first use builds it), "built"."""
    if importlib.util.find_spec("deepspeed") is None:
        return "no-deepspeed", "the deepspeed package is not installed"
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    builder = _aio_builder()
    if installed_ops.get("async_io"):
        return "built", "async_io op installed with deepspeed"
    where = Path(_get_build_directory(builder.name, verbose=False))
    if (where / f"{builder.name}.so").is_file():  # (whether it still loads, load() says)
        return "built", f"async_io op built in {where}"
    # DeepSpeed compiles and links a test program against libaio (~1 s): only when not built
    if not builder.is_compatible(verbose=False):
        return "no-libaio", "libaio (its headers and library) was not found"
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
                          f"({e.strerror}; tmpfs before Linux 6.6 does), which DeepSpeed's NVMe offload uses; fix: "
                          "point it at a directory on a disk (ext4, xfs)") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def check(cfg: Config) -> None:
    """Before any rank starts: a run that offloads to nvme can write its swap files and load
    DeepSpeed's async_io op."""
    if cfg.strategy.deepspeed.offload_device != "nvme" and not _json_offloads_nvme(cfg):
        return
    ds = deepspeed_config(cfg, 1, device_type(cfg))
    for path in swap_dirs(ds):
        check_direct_io(path, "strategy.deepspeed.nvme_path")
    check_aio()


def _json_offloads_nvme(cfg: Config) -> bool:
    if not cfg.strategy.deepspeed.config:
        return False
    try:
        return bool(nvme_offloads(deepspeed_config(cfg, 1, device_type(cfg))))
    except DtlabError:
        return False  # the config's own error is said by the config check


def swap_dirs(ds: dict[str, Any]) -> list[Path]:
    """The directories a run's NVMe offload writes into (one or two nvme_path values)."""
    zero = ds["zero_optimization"]
    return sorted({Path(zero[k]["nvme_path"]) for k in nvme_offloads(ds)})


