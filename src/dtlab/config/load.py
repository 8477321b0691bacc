"""Loading: a YAML file (or the built-in quick defaults) plus dotted `key=value` overrides.

Problems become a ConfigError whose one-line message names the key and the fix; the CLI prints it
and exits 2.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from dtlab.config.limits import check_integers
from dtlab.config.schema import CNNConfig, Config, GPTConfig, HFConfig, ResNetConfig
from dtlab.errors import ConfigError


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (PyYAML follows YAML 1.1 and reads a string)
    and refuses a key written twice in one mapping (PyYAML keeps the last one without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(None, None, f"key '{key}' is written twice, here and at "
                                    f"line {seen[key].line + 1}", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


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


def read_yaml(path: str | Path, what: str = "config file",
              fix: str = "pass an existing YAML file to --config",
              empty_fix: str = "write its settings into it, or leave out --config to use the "
                               "built-in defaults") -> dict[str, Any]:
    """The mapping in a YAML file; anything else (no file, a directory, unreadable, binary, not
    YAML, empty, not a mapping) is a ConfigError naming the file and the fix."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} '{p}' is a directory, not a file; fix: {fix}")
    if not p.is_file():
        raise ConfigError(f"{what} '{p}' not found; fix: {fix}")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{what} '{p}' cannot be read ({e.strerror}); fix: check its "
                          "permissions (chmod u+r)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{p}' is not UTF-8 text (byte {e.start}); fix: {fix}, "
                          "not a binary file") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        fix_yaml = ("write the key once, with everything it should hold" if
                    isinstance(e, _DuplicateKey) else
                    "correct the syntax there (plain YAML: no tags, one document)")
        raise ConfigError(f"{what} '{p}' is not valid YAML{line} ({problem}); fix: {fix_yaml}"
                          ) from None
    if data is None:
        raise ConfigError(f"{what} '{p}' is empty (or only comments); fix: {empty_fix}")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{p}' must hold a mapping of sections (key: value lines), "
                          f"not a {type(data).__name__}; fix: e.g. `train: {{lr: 0.1}}`")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{what} '{p}': key {key!r} is not a name; fix: use section "
                              "names such as train, model, strategy (`dtlab config --keys`)")
    return data


def apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or "" in key.split("."):
        raise ConfigError(f"override '{item}' must look like key=value; fix: e.g. train.lr=0.1")
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{item}': '{part}' is a value, not a section; fix: "
                              "see `dtlab config --keys` for valid keys")
        node = child
    if not value.strip():  # `run.dir=` (or run.dir='' in a shell): not the default in disguise
        raise ConfigError(f"override '{item}' gives {key} no value; fix: {key}=VALUE, or leave "
                          "it out for its default")
    # `~` alone is YAML's null; on a command line it is the home directory (a shell expands it
    # only at the start of a word)
    node[parts[-1]] = "~" if value.strip() == "~" else parse_value(value)


def _switch_model(tree: dict[str, Any], from_file: dict[str, Any], overridden: set[str]) -> None:
    """When the overrides name another model than the file, the file's options of its own model
    go: `--config gpt.yaml model.name=cnn` gives the cnn defaults (as without --config) plus the
    model.* overrides (`overridden`: the option names they set)."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    before, after = from_file.get("name", "cnn"), model.get("name", "cnn")
    if before == after or after not in _MODELS:
        return
    fields = _MODELS[after].model_fields
    for key in [k for k in model if k in from_file and k not in fields and k not in overridden]:
        del model[key]


def _switch_hf_source(tree: dict[str, Any], keys: list[list[str]]) -> None:
    """`--config hf_llama.yaml model.hf.path=DIR` trains the directory's model: the file's
    model.hf.config fields (another model's sizes) go, those given beside the path stay."""
    if ["model", "hf", "path"] not in keys or ["model", "hf", "config"] in keys:
        return
    hf = tree["model"].get("hf") if isinstance(tree.get("model"), dict) else None
    if isinstance(hf, dict) and isinstance(hf.get("config"), dict):
        kept = {k[3] for k in keys if len(k) > 3 and k[:3] == ["model", "hf", "config"]}
        hf["config"] = {k: v for k, v in hf["config"].items() if k in kept} or None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the built-in quick defaults), apply overrides and validate."""
    tree = read_yaml(path) if path is not None else {}
    file_model = dict(tree["model"]) if isinstance(tree.get("model"), dict) else None
    for item in overrides:
        apply_override(tree, item)
    if file_model is not None:
        keys = [item.partition("=")[0].strip().split(".") for item in overrides]
        _switch_model(tree, file_model, {k[1] for k in keys if len(k) > 1 and k[0] == "model"})
        _switch_hf_source(tree, keys)
    check_integers(tree)  # before the schema's own checks, which may compute with them
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    if cfg.run.dir is None:
        stem = Path(path).stem if path is not None else "quick"
        cfg.run.dir = f"runs/{stem}-{cfg.strategy.name}"
    return cfg


def _fields(key: str) -> list[Any]:
    """The schema fields a dotted key names (model.* may belong to several models)."""
    models: list[type[BaseModel]] = [Config]
    *sections, last = key.split(".")
    for part in sections:
        subs: list[type[BaseModel]] = []
        for m in models:
            field = m.model_fields.get(part)
            if m is Config and part == "model":
                subs += list(_MODELS.values())
            elif field is not None and isinstance(field.annotation, type) and issubclass(
                    field.annotation, BaseModel):
                subs.append(field.annotation)
        models = subs
    return [m.model_fields[last] for m in models if last in m.model_fields]


def check_value(key: str, value: Any) -> str | None:
    """Why `key=value` is wrong by itself (its type or range), or None. Checks of combinations
    (one key against another) are left to the whole config."""
    fields = _fields(key)
    if not fields:
        return None
    value = parse_value(_format(value))  # as an override passes it
    problem = None
    for field in fields:
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            return None
        try:
            kind = (Annotated[(field.annotation, *field.metadata)] if field.metadata
                    else field.annotation)
            TypeAdapter(kind).validate_python(value)
            return None
        except ValidationError as e:
            problem = e.errors()[0]["msg"]
        except Exception:  # noqa: BLE001 - a field pydantic cannot check alone: the config will
            return None
    return f"{problem} (got {value!r})"


def _format(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, (list, dict)) else str(value)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------- error messages
_MODELS: dict[str, type[BaseModel]] = {"cnn": CNNConfig, "resnet": ResNetConfig, "gpt": GPTConfig,
                                        "hf": HFConfig}


# pydantic names the member of a union it tried after the field ("bool", "literal['auto']")
_UNION_MEMBER = re.compile(r"^(bool|int|float|str|bytes|none|[\w-]+\[.*\])$")


def _dotted(loc: tuple[Any, ...]) -> str:
    """The key a user writes for an error's location: without pydantic's union tags (the model
    name, a member type) and list positions (train.betas, not train.betas.0)."""
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] == "model" and parts[1] in _MODELS:
        del parts[1]
    for i, part in enumerate(parts[1:], 1):
        if isinstance(loc[i + (len(loc) - len(parts))], int) or _UNION_MEMBER.match(part):
            del parts[i:]
            break
    return ".".join(parts)


def valid_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        subs = [ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []
        if name == "model" and model is Config:
            subs = list(_MODELS.values())
        for sub in subs:
            keys += valid_keys(sub, f"{prefix}{name}.")
        if not subs:
            keys.append(prefix + name)
    return sorted(set(keys))


def _closest_key(key: str, choices: list[str]) -> str | None:
    """The valid key closest to `key` segment by segment (trian.max_steps -> train.max_steps:
    a whole-string match would pick train.lr), else the closest as a whole."""
    chosen: list[str] = []
    for i, part in enumerate(key.split(".")):
        level = sorted({c.split(".")[i] for c in choices
                        if c.split(".")[:i] == chosen and len(c.split(".")) > i})
        pick = part if part in level else next(
            iter(difflib.get_close_matches(part, level, n=1, cutoff=0.6)), None)
        if pick is None:
            break
        chosen.append(pick)
    else:
        if ".".join(chosen) in choices and ".".join(chosen) != key:
            return ".".join(chosen)
    close = difflib.get_close_matches(key, [k for k in choices if k != key], n=1, cutoff=0.6)
    return close[0] if close else None


def _typed(key: str, value: Any) -> str:
    """The key the user typed: a section's name and, when it holds a single option, that option
    (`trian.max_steps=3` arrives as section 'trian' holding {max_steps: 3})."""
    while isinstance(value, dict) and len(value) == 1:
        (sub, value), = value.items()
        key = f"{key}.{sub}"
    return key


def _unknown_key(key: str, loc: tuple[Any, ...], value: Any = None) -> str:
    if key.startswith("model.") and len(loc) > 1 and loc[1] in _MODELS:
        name, option = str(loc[1]), key.removeprefix("model.")
        owners = [n for n, m in _MODELS.items() if option in m.model_fields]
        if owners:  # an option of another model: say which, and how to get it
            return (f"config key '{key}' belongs to model.name={' or '.join(owners)}, not "
                    f"model.name={name}; fix: remove {key}, or set model.name={owners[0]}")
        close = _closest_key(_typed(key, value), valid_keys(_MODELS[name], "model."))
        other = _closest_of_other_models(option, name)
        if other is not None and (close is None or _likeness(option, other[0]) >
                                  _likeness(option, close.removeprefix("model."))):
            return (f"unknown config key '{key}'; fix: remove it (did you mean "
                    f"'model.{other[0]}', an option of model.name={other[1]}?)")
    else:
        close = _closest_key(_typed(key, value), valid_keys())
    hint = f"did you mean '{close}'?" if close else "see `dtlab config --keys` for valid keys"
    return f"unknown config key '{key}'; fix: remove it ({hint})"


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _closest_of_other_models(option: str, name: str) -> tuple[str, str] | None:
    """(option, model) of another model that `option` most looks like (model.n_lyer under
    the default cnn: gpt's n_layer), or None."""
    found = [(_likeness(option, o), o, n) for n, m in _MODELS.items() if n != name
             for o in m.model_fields if o != "name"]
    best = max(found, default=(0.0, "", ""))
    return (best[1], best[2]) if best[0] >= 0.75 else None


def _expected(msgs: list[str]) -> str:
    """pydantic's messages for the members of one union, as one: "Input should be a valid
    boolean or 'auto'"."""
    wanted = [m.removeprefix("Input should be ").split(", unable to")[0] for m in msgs]
    if all(m.startswith("Input should be ") for m in msgs):
        return "Input should be " + " or ".join(dict.fromkeys(wanted))
    return msgs[0]


def format_validation_error(e: ValidationError, overrides: bool = True) -> str:
    """One line: the first problem, its key and the fix (`overrides`: the key can also be given
    as key=value on the command line)."""
    errors = e.errors()
    err = errors[0]
    key = _dotted(err["loc"])
    same = [x for x in errors if _dotted(x["loc"]) == key]  # a union's members: one problem
    others = len({_dotted(x["loc"]) for x in errors} - {key})
    more = f" (and {others} more problem(s))" if others else ""
    if err["type"] == "extra_forbidden":
        return _unknown_key(key, err["loc"], err.get("input")) + more
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":  # our own checks already name keys and fixes
        return msg + more
    if err["type"] == "union_tag_invalid":
        return f"{key}.name: {msg}; fix: use one of {', '.join(_MODELS)}{more}"
    msg = _expected([x["msg"] for x in same])
    got = err.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    where = f"in the file or as {key}=..." if overrides else "in the file"
    return f"{key}: {msg}{shown}; fix: set {key} to a valid value {where}{more}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1, "c": {}}} -> {"a.b": 1, "a.c": {}}: dotted keys, as overrides name them;
    lists, empty mappings and other leaves are kept as they are."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}
