"""The transformers config of `model.name=hf`: read once per process from model.hf.path's
config.json and/or the fields of model.hf.config, with what can be said about those files before
transformers speaks (a model type it knows, no misspelt field).

In the config layer because the config itself reads it (`HFConfig.vocab_size`); building the model
and the deeper checks are dtlab/models/hf.py's and hf_check.py's. Imports transformers only when
a config is read (the `hf` extra).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

from dtlab.errors import ConfigError

# transformers' scaled-dot-product attention under a name that has no mask function: dtlab's
# token windows are never padded or packed, so attention is plainly causal (sdpa's is_causal)
# and transformers skips building a mask, including the packed-sequence check whose
# `.all()` waits for the device in every forward (and cannot run on meta tensors).
ATTENTION = "dtlab_causal_sdpa"
# What every from_pretrained of dtlab's passes: transformers >= 5.2x swaps layers for the `kernels`
# package's hub kernels while loading (fetched online; it refuses the meta device), so the loaded
# model would run other code than the same model built from its config.
LOADING = {"use_kernels": False}
_CONFIGS: dict[str, Any] = {}  # one transformers config per (path, config) in a process


def require_transformers(what: str = "model.name=hf") -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs the transformers package; "
                          "fix: pip install 'dtlab[hf]'") from None
    if ATTENTION not in transformers.AttentionInterface._global_mapping:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        transformers.AttentionInterface.register(ATTENTION, sdpa_attention_forward)
        transformers.logging.set_verbosity_error()  # no advice lines from every rank
        transformers.logging.disable_progress_bar()  # nor a loading bar
    return transformers


def _check_fields(cfg: Any, fields: dict[str, Any]) -> None:
    """transformers configs keep any keyword as an attribute: a misspelt field would be ignored
    silently. Refuse fields that the config class neither knows nor converts (as it converts
    Llama's older `rope_theta` into `rope_parameters`)."""
    known, held = set(type(cfg)().to_dict()), cfg.to_dict()
    for key in fields:
        if key in held and key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"see {type(cfg).__name__}'s fields"
            raise ConfigError(f"model.hf.config.{key} is not a field of {type(cfg).__name__}; "
                              f"fix: remove it ({hint})")


def _strict(make: Any, where: str) -> Any:
    """A config from `make()`; a field of the wrong type (transformers' configs are strict
    dataclasses), or fields that contradict each other (heads that do not divide the width), is
    one line naming `where` the fields came from (model.hf.config, or a directory's config.json)."""
    from huggingface_hub.errors import (
        StrictDataclassClassValidationError,
        StrictDataclassFieldValidationError,
    )

    try:
        return make()
    except StrictDataclassFieldValidationError as e:  # "...field 'x':\n  TypeError: why (value: v)"
        found = re.search(r"field '(\w+)':\s*\w+: (.*) \(value: (.*)\)$", str(e), re.S)
        field, why, value = found.groups() if found else ("?", str(e).splitlines()[-1], "?")
        name = f"{where}.{field}" if where == "model.hf.config" else f"{where} field {field}"
        raise ConfigError(f"{name}={value.strip(chr(39))}: {why}; fix: give it a value of that "
                          "type") from None
    except StrictDataclassClassValidationError as e:  # "...:\n    ValueError: why"
        why = str(e).strip().splitlines()[-1].split(": ", 1)[-1].rstrip(".")
        raise ConfigError(f"{where}: {why}; fix: change those fields so that they agree") from None


def hf_config(m: Any) -> Any:
    """The transformers config of an HFConfig (dtlab.config.HFConfig), loaded once per process:
    the directory's config.json and/or the fields of model.hf.config."""
    key = json.dumps([m.hf.path, m.hf.config], sort_keys=True, default=str)
    if key not in _CONFIGS:
        _CONFIGS[key] = load_hf_config(m, dict(m.hf.config or {}))
    return _CONFIGS[key]


def load_hf_config(m: Any, fields: dict[str, Any]) -> Any:
    t = require_transformers()
    path = m.hf.path
    if path is not None:
        model_type = fields.pop("model_type", None)  # the directory's config.json names it
        if Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"model.hf.path '{path}' is a file; fix: give the directory that "
                              "holds config.json and the weights")
        if Path(path).is_dir():
            check_file_type(path, t.CONFIG_MAPPING)
        try:
            cfg = _strict(lambda: t.AutoConfig.from_pretrained(path, **fields),
                          f"model.hf.path '{path}' (config.json{' + model.hf.config' * bool(fields)})")
        except (OSError, ValueError) as e:
            local = Path(path).is_dir() or path.startswith((".", "/", "~"))
            why = ("has no readable config.json" if local else
                   "is no local directory, and the hub is unreachable or has no such model")
            raise ConfigError(f"model.hf.path '{path}' {why} ({str(e).splitlines()[0][:120]}); "
                              "fix: point it at a model directory (config.json + *.safetensors), "
                              "e.g. one written by `dtlab export --format hf`") from None
        if model_type not in (None, cfg.model_type):
            raise ConfigError(f"model.hf.config.model_type={model_type}, but model.hf.path "
                              f"'{path}' holds a {cfg.model_type} model (its config.json); fix: "
                              "remove model.hf.config.model_type: the directory names the type")
        check_file_fields(cfg, path)
    else:
        model_type = fields.pop("model_type")
        if model_type not in t.CONFIG_MAPPING:
            raise ConfigError(f"model.hf.config.model_type={model_type} is not a model type "
                              "transformers knows; fix: e.g. llama, gpt2, qwen2, mistral")
        cfg = _strict(lambda: t.AutoConfig.for_model(model_type, **fields), "model.hf.config")
    _check_fields(cfg, fields)
    return cfg


def check_file_type(path: str, known: Any) -> None:
    """A directory's config.json names a model type transformers knows (`known`: its
    CONFIG_MAPPING), said before transformers' own, longer, message."""
    file = Path(path) / "config.json"
    try:
        written = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # transformers says what is wrong with the file itself
    if not isinstance(written, dict):
        raise ConfigError(f"model.hf.path: {file} holds a {type(written).__name__}, not a "
                          "config (an object of fields); fix: write the model's config there")
    model_type = written.get("model_type")
    if model_type is None:
        raise ConfigError(f"model.hf.path: {file} has no model_type; fix: add it there (e.g. "
                          "\"model_type\": \"llama\")")
    if model_type not in known:
        raise ConfigError(f"model.hf.path: {file} names model_type={model_type!r}, which "
                          "this transformers does not know; fix: correct it there (e.g. llama, "
                          "gpt2, qwen2, mistral), or upgrade transformers")


def check_file_fields(cfg: Any, path: str) -> None:
    """A field of config.json that the config class neither knows nor converts, and that is
    close to one it knows, is a misspelling. Unrelated extra keys (metadata other tools write,
    dtlab's own) are left alone."""
    file = Path(path) / "config.json"
    try:
        written = json.loads(file.read_text())
    except (OSError, ValueError):
        return  # transformers read it; nothing more to say here
    known = set(type(cfg)().to_dict()) | set(getattr(type(cfg), "attribute_map", {}))
    held = cfg.to_dict()
    for key in written if isinstance(written, dict) else ():
        if key in known or key not in held or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"model.hf.path '{path}': config.json field '{key}' is not a field "
                              f"of {type(cfg).__name__} (did you mean '{close[0]}'?); fix: "
                              f"rename it in {file}")
