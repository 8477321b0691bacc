"""The device and the process-group backend a run will use, from run.device and run.backend
(dtlab/distributed.py makes the same choice when the run starts). Its own module, below the
strategies' descriptions and world.py, because both ask it before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtlab.config.schema import Config


def device_type(cfg: Config) -> str:
    """The device type a run will use (imports torch only when run.device=auto)."""
    if cfg.run.device != "auto":
        return cfg.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_type(cfg: Config) -> str:
    """The process-group backend a run will use (dtlab/distributed.py's choice)."""
    if cfg.run.backend != "auto":
        return cfg.run.backend
    return "nccl" if device_type(cfg) == "cuda" else "gloo"
