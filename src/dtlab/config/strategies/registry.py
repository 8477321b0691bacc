"""The registry: every strategy dtlab has, from one list of descriptions (`*_spec.py`).

Config, compare, collect, estimate, the breakdown and the report ask it; nothing outside
`dtlab/strategies/` compares a value with a strategy's name. Adding a strategy: write its module
and its description, and import its description module into MODULES below
(docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dtlab.config.strategies import (
    cp_spec,
    ddp_spec,
    deepspeed_spec,
    fsdp1_spec,
    fsdp_spec,
    hsdp_spec,
    pp_spec,
    single_spec,
    tp_spec,
    zero1_spec,
)
from dtlab.config.strategies import layout_syntax as layout
from dtlab.config.strategies.spec import StrategySpec
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config

# One description module per strategy family, in the order help texts list them.
MODULES = (single_spec, ddp_spec, fsdp_spec, fsdp1_spec, zero1_spec, deepspeed_spec, tp_spec,
           pp_spec, hsdp_spec, cp_spec)
SPECS: dict[str, StrategySpec] = {  # every description a module declares, in its order
    spec.name: spec for module in MODULES for spec in vars(module).values()
    if isinstance(spec, StrategySpec)
}
NAMES = tuple(SPECS)
REFERENCE = "single"  # `compare --verify` checks every strategy against it
BASELINE = "ddp"  # findings state memory and speed relative to it


def get(name: str) -> StrategySpec:
    if name not in SPECS:
        raise ConfigError(f"unknown strategy '{name}'; fix: use {', '.join(NAMES)}")
    return SPECS[name]


def of(cfg: Config) -> StrategySpec:
    return SPECS[cfg.strategy.name]


# ------------------------------------------------------------------------ NAME[:VARIANT][@SHAPE]
def parse_shape(text: str, shape: str) -> tuple[int, int]:
    """`2x2` -> (data-parallel, model-parallel) ranks; `2` -> (1, 2)."""
    parts = shape.split("x")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--strategies: '{text}' has a bad mesh shape '{shape}'; fix: @MP or @DPxMP with "
            "positive integers, e.g. fsdp_tp@2x2 (2 replicas x 2 tensor-parallel ranks)"
        )
    dims = [int(p) for p in parts]
    return (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])


def parse(text: str) -> list[str]:
    """A strategy spec as `compare` and `estimate` take it -> the overrides selecting it.

    `NAME[:VARIANT][@SHAPE]`: a variant sets the strategy's variant key (fsdp1:SHARD_GRAD_OP,
    pp:interleaved_1f1b, deepspeed:3); a shape, `@MP` or `@DPxMP`, sets its mesh key to MP
    (fsdp_tp@2x2: 2 data-parallel replicas x 2 tensor-parallel ranks; see `ranks`).
    """
    head, at, shape = text.partition("@")
    name, colon, variant = head.partition(":")
    if name in SPECS and layout.is_layout(text):  # FLAVOUR@DIMn...: config/layout.py
        return layout.overrides(text)
    if name not in SPECS:
        raise ConfigError(f"--strategies: unknown strategy '{name}'; fix: use {', '.join(NAMES)}")
    spec = SPECS[name]
    if (colon and not variant) or (at and not shape):  # `ddp:` would run as ddp, named `ddp:`
        mark, example = (":", spec.variant and f"{name}:{(spec.variant[1][1:] or spec.variant[1])[0]}") \
            if colon and not variant else ("@", spec.mesh_key and f"{name}@2x2")
        raise ConfigError(f"--strategies: '{text}' ends in '{mark}' with nothing after it; fix: write "
                          f"{name}" + (f", or e.g. {example}" if example else ""))
    overrides = [f"strategy.name={name}"]
    if variant:
        if spec.variant is None or variant not in spec.variant[1]:
            first, *rest = [f"{s.name} {s.variant[2]}" for s in SPECS.values() if s.variant]
            listed = ", ".join([first.replace(" ", " takes ", 1), *rest[:-1]])
            listed += f" and {rest[-1]}" if rest else ""
            raise ConfigError(f"--strategies: '{text}' is not valid; fix: only {listed}")
        overrides.append(f"{spec.variant[0]}={variant}")
    if shape:
        if spec.mesh_key is None:
            meshes = ", ".join(s.name for s in SPECS.values() if s.mesh_key)
            raise ConfigError(
                f"--strategies: '{text}': only {meshes} take a mesh shape; fix: remove the @ part")
        overrides.append(f"{spec.mesh_key}={parse_shape(text, shape)[1]}")
    return overrides


def mesh(text: str) -> tuple[int, int] | None:
    """The (data-parallel, model-parallel) ranks a spec's shape asks for; None without one (or
    for a layout whose data-parallel dimension takes the ranks there are)."""
    shape = text.partition("@")[2]
    if layout.is_layout(text):
        fixed = layout.ranks(text)
        return None if fixed is None else (1, fixed)
    return parse_shape(text, shape) if shape else None


def mesh_mismatch(text: str, n: int, flag: str) -> str | None:
    """The one line refusing a spec whose mesh is not `n` ranks (`flag` gave n), else None."""
    shape = mesh(text)
    if shape is None or shape[0] * shape[1] == n:
        return None
    if layout.is_layout(text):
        flavour, _, dims = text.partition("@")
        return (f"--strategies {text} runs on {shape[1]} ranks (no data parallelism: "
                f"{flavour}), and {flag} is {n}; fix: {flag} {shape[1]}, or fsdp@{dims} for "
                f"data parallelism over the other ranks")
    dp, mp = shape
    other = f"{text.partition('@')[0]}@{n // mp}x{mp} for {n} ranks, or " if n % mp == 0 else ""
    return (f"--strategies {text} runs on {dp}x{mp} = {dp * mp} ranks, and {flag} is {n}; fix: "
            f"{other}{flag} {dp * mp}")


def fixed_ranks(text: str) -> int | None:
    """Ranks a spec runs on whatever --nproc-per-node says: 1 for a one-process strategy, the
    mesh's size when it has one; None when it runs on --nproc-per-node."""
    shape = mesh(text)
    if shape:
        return shape[0] * shape[1]
    spec = SPECS.get(text.partition(":")[0])
    return 1 if spec is not None and spec.one_process else None


def ranks(text: str, default: int) -> int:
    """Ranks a spec runs on: `fixed_ranks`, else `default`."""
    return fixed_ranks(text) or default


def label(summary: dict[str, Any]) -> str:
    """A run's name in results, as `dtlab compare --strategies` writes it (mesh as @DPxMP)."""
    name = summary.get("strategy", "")
    options = summary.get("strategy_options") or {}
    text = SPECS[name].label_of(options) if name in SPECS else name
    mesh = options.get("mesh") or {}
    if len(mesh) == 2 and list(mesh.values())[0] > 1:  # two dimensions, both used: DPxMP
        text += "@{}x{}".format(*mesh.values())
    return text


def spec_of_label(text: str) -> StrategySpec | None:
    return SPECS.get(str(text).partition(":")[0].partition("@")[0])
