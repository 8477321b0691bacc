"""Integers a run cannot use, refused before any rank starts.

A step count, an epoch count or a size of a hundred digits passes the schema's types and then ends
deep in a rank with a traceback (`islice`'s "Stop argument must be ... <= sys.maxsize", torch's
"Overflow when unpacking long long", an allocation of exabytes). Two bounds catch them at load:
- every integer of a config is at most MAX_INT = 2**53, the largest integer a JSON reader (the
  report's JavaScript, jq) holds exactly: no count or size a run can use comes near it;
- the synthetic data set, which each rank makes in memory, fits in this machine's memory.
What the model's sizes allocate is checked where the model is built on the meta device
(dtlab.models.check_model_size), and a run's total steps where epochs meet the data's length
(dtlab.train.total_steps).
"""

from __future__ import annotations

from typing import Any

from dtlab.config.schema import LANGUAGE_MODELS
from dtlab.errors import ConfigError
from dtlab.files import meminfo

MAX_INT = 2**53


def check_integers(tree: Any, prefix: str = "") -> None:
    """ConfigError naming the first integer of `tree` (a config as read, overrides applied) over
    MAX_INT."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            check_integers(value, f"{prefix}{key}.")
    elif isinstance(tree, list | tuple):
        for value in tree:
            check_integers(value, prefix)
    elif isinstance(tree, int) and not isinstance(tree, bool) and abs(tree) > MAX_INT:
        key = prefix.rstrip(".")
        raise ConfigError(f"{key}={tree} is past what a run can use (at most 2**53 = "
                          f"{MAX_INT:,}); fix: a smaller {key}")


def synthetic_bytes(cfg: Any) -> int:
    """Bytes of the synthetic data set one rank makes: fp32 images, or int64 token windows."""
    s = cfg.data.synthetic
    if cfg.model.name in LANGUAGE_MODELS:
        per_sample = 8 * (cfg.model.block_size + 1)
    else:
        per_sample = 4 * s.in_channels * s.image_size**2 + 8
    return (s.train_samples + s.val_samples) * per_sample


def check_fits_machine(cfg: Any) -> None:
    """The synthetic data set of one rank fits in this machine's memory."""
    memory = meminfo().get("MemTotal")
    if cfg.data.name != "synthetic" or not memory:
        return
    need = synthetic_bytes(cfg)
    if need > memory:
        s = cfg.data.synthetic
        raise ConfigError(
            f"data.synthetic: {s.train_samples:,} + {s.val_samples:,} samples make "
            f"{need / 1e9:,.1f} GB of synthetic data on each rank, more than this machine's "
            f"{memory / 1e9:.1f} GB of memory; fix: fewer data.synthetic.train_samples or "
            "val_samples, or smaller samples")
