"""How a layout is written: `FLAVOUR@DIMn[.DIMn...]` in --strategies (`fsdp@pp2.tp2`), and the
`Layout` value (dtlab/config/layout.py resolves layouts to the strategies that run them). Plain
text: the registry's parser uses it, and it uses nothing of the registry's."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dtlab.errors import ConfigError

DIMS = ("pp", "tp", "cp")  # the model-parallel dimensions, in the order a layout is written
WHAT = {"pp": "pipeline", "tp": "tensor", "cp": "context"}
_DIM = re.compile(r"^(pp|tp|cp)([0-9]+)$")


@dataclass(frozen=True)
class Layout:
    """A flavour and its degrees; `dp` the data-parallel ranks (None where the world is not known)."""

    flavour: str
    pp: int = 1
    tp: int = 1
    cp: int = 1
    dp: int | None = None

    @property
    def model_parallel(self) -> int:
        return self.pp * self.tp * self.cp

    def text(self) -> str:
        """`fsdp@pp2.tp2`; the flavour alone without model parallelism."""
        dims = ".".join(f"{d}{getattr(self, d)}" for d in DIMS if getattr(self, d) > 1)
        return f"{self.flavour}@{dims}" if dims else self.flavour


def is_layout(text: str) -> bool:
    """Whether a `--strategies` item is written as FLAVOUR@DIMn... (not NAME@DPxMP)."""
    shape = text.partition("@")[2]
    return bool(shape) and shape[0].isalpha()


def parse(text: str) -> dict[str, int]:
    """`fsdp@pp2.tp2` -> {"pp": 2, "tp": 2}, or the one line saying what is wrong."""
    flavour, _, dims = text.partition("@")
    degrees: dict[str, int] = {}
    for part in dims.split("."):
        m = _DIM.match(part)
        if m is None or int(m.group(2)) < 1:
            raise ConfigError(f"--strategies: '{text}' has a bad dimension '{part}'; fix: "
                              f"{flavour}@ then {', '.join(DIMS)} each followed by its degree, "
                              "joined by dots, e.g. fsdp@pp2.tp2")
        if m.group(1) in degrees:
            raise ConfigError(f"--strategies: '{text}' gives {m.group(1)} twice; fix: give each "
                              "dimension once")
        degrees[m.group(1)] = int(m.group(2))
    return degrees


def overrides(text: str) -> list[str]:
    """The config overrides selecting the layout `text`."""
    flavour = text.partition("@")[0]
    return [f"strategy.name={flavour}", *(f"parallel.{d}={n}" for d, n in parse(text).items())]


def ranks(text: str) -> int | None:
    """Ranks the layout `text` runs on when that is fixed (flavour single: the product of its
    degrees), else None (the data-parallel dimension takes what --nproc-per-node gives)."""
    if text.partition("@")[0] != "single":
        return None
    n = 1
    for degree in parse(text).values():
        n *= degree
    return n
