"""A run's layout: the data-parallel flavour (`strategy.name`) over the ranks that the
model-parallel degrees (`parallel.pp`, `parallel.tp`, `parallel.cp`) leave, on one device mesh.

    dtlab train --nproc-per-node 4 strategy.name=fsdp parallel.tp=2     # FSDP2 x TP, 2 x 2
    dtlab compare --strategies single,fsdp@tp2,single@pp2 --nproc-per-node 4 ...

`FLAVOUR@DIMn[.DIMn...]` (`fsdp@pp2.tp2`, strategies/layout_syntax.py) is the same layout in
`--strategies`. The flavour `single` means no data parallelism: the ranks are the product of the
degrees.

A layout runs on the implementation that has it: `resolve` rewrites the degrees into that
strategy's own keys before the config is validated (`single@tp2` -> strategy.name=tp with
strategy.tp.degree=2, `fsdp@tp2` -> fsdp_tp, `fsdp@pp2` -> pp with strategy.pp.dp=fsdp). Those
names and keys stay valid as shorthands of the same layouts; `layout_of` reads a config either
way. A combination without an implementation is refused in one line, with the nearest that runs.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from pydantic import PositiveInt

from dtlab.config.options import Section
from dtlab.config.strategies import registry
from dtlab.config.strategies.layout_syntax import DIMS, WHAT, Layout
from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from dtlab.config import Config
    from dtlab.config.strategies.spec import StrategySpec


class ParallelConfig(Section):
    """Model-parallel degrees: ranks per pipeline, per tensor-parallel group, per context-parallel
    group (1 = that dimension is not used). The data-parallel flavour is strategy.name."""

    pp: PositiveInt = 1
    tp: PositiveInt = 1
    cp: PositiveInt = 1


def _nearest(flavour: str, degrees: dict[str, int]) -> str:
    """The nearest layout that runs: with the flavour that runs there (fsdp), or with the
    largest degree alone."""
    if _runner(degrees, flavour):
        return Layout(flavour, **degrees).text()
    if _runner(degrees, "fsdp"):
        return Layout("fsdp", **degrees).text()
    dim = max(degrees, key=lambda d: degrees[d])
    return _nearest(flavour, {dim: degrees[dim]})


def _runners(degrees: dict[str, int]) -> list[StrategySpec]:
    """The strategies that run these model-parallel degrees (their descriptions say so: a
    model_dim among them, the more_dims it composes with covering the rest)."""
    return [s for s in registry.SPECS.values() if s.model_dim in degrees
            and set(degrees) <= {s.model_dim, *(d for d, _ in s.more_dims)}]


def _runner(degrees: dict[str, int], flavour: str) -> StrategySpec | None:
    """The one of them that runs `flavour` over its data-parallel ranks."""
    return next((s for s in _runners(degrees) if flavour in s.flavours), None)


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refuse(flavour: str, degrees: dict[str, int], why: str) -> ConfigError:
    asked = Layout(flavour, **degrees).text()
    return ConfigError(f"the layout {asked} (strategy.name={flavour} with "
                       + " ".join(f"parallel.{d}={n}" for d, n in degrees.items())
                       + f") {why}; fix: {_nearest(flavour, degrees)}")


def resolve(tree: dict[str, Any]) -> dict[str, Any]:
    """A config tree (as read, overrides applied) with its parallel.* degrees rewritten into the
    keys of the strategy that runs them (see the module's docstring); `tree` unchanged when
    every degree is 1. Values pydantic would refuse are left for it to refuse."""
    given = tree.get("parallel")
    if not isinstance(given, dict):
        return tree
    degrees = {d: given[d] for d in DIMS if isinstance(given.get(d), int)
               and not isinstance(given.get(d), bool) and given[d] > 1}
    strategy = tree.get("strategy") or {}
    if not degrees or not isinstance(strategy, dict):
        return tree
    flavour = strategy.get("name", "single")
    if _is_runner(flavour):
        raise ConfigError(f"strategy.name={flavour} is itself a model-parallel layout; fix: name "
                          "the data-parallel flavour with parallel.* degrees (strategy.name=fsdp "
                          "parallel.tp=2), or the shorthand alone (strategy.tp.degree, "
                          "strategy.pp.degree)")
    runner = _runner(degrees, flavour)
    if runner is None:
        dims = " x ".join(WHAT[d] for d in degrees)
        over = sorted({f for s in _runners(degrees) for f in s.flavours})
        why = (f"puts {flavour} over {dims}-parallel groups, which dtlab runs with "
               f"{_either(over)} only") if over else f"composes {dims} parallelism, which " \
            "dtlab does not run"
        raise _refuse(flavour, degrees, why)
    out = {**tree, "parallel": {**given, **dict.fromkeys(degrees, 1)},
           "strategy": {**strategy, "name": runner.name}}
    keys = [(runner.mesh_key, runner.model_dim, degrees[runner.model_dim]),
            *((key, d, degrees[d]) for d, key in runner.more_dims if d in degrees),
            (runner.flavour_key, None, "none" if flavour == "single" else flavour)]
    for key, dim, value in keys:
        if key is None:
            continue
        *sections, last = key.split(".")
        node = out
        for part in sections:  # copies: the caller's tree is left as it was
            node[part] = node = dict(node.get(part) or {})
        if node.get(last) not in (None, 0, value):
            given_as = f"parallel.{dim}={value}" if dim else f"strategy.name={flavour}"
            raise ConfigError(f"{given_as} and {key}={node[last]} disagree; fix: give the "
                              "layout once, as strategy.name and parallel.*")
        node[last] = value
    return out


def _is_runner(name: Any) -> bool:
    spec = registry.SPECS.get(name) if isinstance(name, str) else None
    return spec is not None and spec.model_dim is not None


def layout_of(cfg: Config, world_size: int) -> Layout:
    """The layout `cfg` runs on `world_size` ranks, however it was written."""
    spec = registry.of(cfg)
    if spec.model_dim is None:
        return Layout(spec.name, dp=world_size)
    mp = spec.model_parallel_size(cfg, world_size)
    dp = max(1, world_size // mp)
    more = {d: functools.reduce(getattr, key.split("."), cfg) for d, key in spec.more_dims}
    flavour = spec.flavours[0]
    if spec.flavour_key is not None:
        chosen = functools.reduce(getattr, spec.flavour_key.split("."), cfg)
        flavour = "single" if chosen == "none" or dp == 1 else chosen
    return Layout(flavour, dp=dp, **{spec.model_dim: mp // math.prod(more.values())}, **more)
