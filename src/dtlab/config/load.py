"""Loading: a YAML file (or the built-in quick defaults) plus dotted `key=value` overrides.

Problems become a ConfigError whose one-line message names the key and the fix; the CLI prints it
and exits 2.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dtlab.config.schema import CNNConfig, Config, GPTConfig, ResNetConfig
from dtlab.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (PyYAML follows YAML 1.1 and reads a string)."""


_Loader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str) -> Any:
    """Parse one override value as YAML (`0.1`, `true`, `[32, 64]`, `FULL_SHARD`)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError:
        return text


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found; fix: pass an existing file to --config")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader)  # noqa: S506
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file '{p}' is not valid YAML{line}; fix its syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections, not {type(data).__name__}")
    return data


def apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. train.lr=0.1")
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = parse_value(value)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the built-in quick defaults), apply overrides and validate."""
    tree = read_yaml(path) if path is not None else {}
    for item in overrides:
        apply_override(tree, item)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    if cfg.run.dir is None:
        stem = Path(path).stem if path is not None else "quick"
        cfg.run.dir = f"runs/{stem}-{cfg.strategy.name}"
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------- error messages
_MODEL_TAGS = {"cnn", "resnet", "gpt"}


def _dotted(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] == "model" and parts[1] in _MODEL_TAGS:
        del parts[1]  # pydantic puts the union tag in the location
    return ".".join(parts)


def valid_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        subs = [ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []
        if name == "model" and model is Config:
            subs = [CNNConfig, ResNetConfig, GPTConfig]
        for sub in subs:
            keys += valid_keys(sub, f"{prefix}{name}.")
        if not subs:
            keys.append(prefix + name)
    return sorted(set(keys))


def format_validation_error(e: ValidationError) -> str:
    errors = e.errors()
    err = errors[0]
    key = _dotted(err["loc"])
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "see `dtlab config --keys` for valid keys"
        return f"unknown config key '{key}'; fix: remove it ({hint}){more}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":  # our own checks already name keys and fixes
        return msg + more
    if err["type"] == "union_tag_invalid":
        return f"{key}.name: {msg}; fix: use one of cnn, resnet, gpt{more}"
    got = err.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{key}: {msg}{shown}; fix: set {key} to a valid value in the file or as {key}=...{more}"
