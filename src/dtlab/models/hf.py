"""Hugging Face causal language models (transformers, the `hf` extra) as dtlab models.

`model.name=hf` builds any `AutoModelForCausalLM` from a local directory (`model.hf.path`, with
its weights) or from config fields alone (`model.hf.config`, random initialisation from the seed,
as a tiny Llama in the tests). `HFCausalLM` adapts it to what the loop expects of a model: token
ids in, logits out, and `blocks()`: the decoder layers, found through the class names the model
itself declares unsplittable (`_no_split_modules`), which every strategy shards, checkpoints and
compiles one by one. Its parameters are named `lm.<the transformers name>`; export strips `lm.`.

Built under `torch.device("meta")` (FLOP counting, estimates), the model comes from its config
only: an 8B model's shapes without reading or allocating its weights.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtlab.errors import ConfigError
from dtlab.models import hf_check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# transformers' scaled-dot-product attention under a name that has no mask function: dtlab's
# token windows are never padded or packed, so attention is plainly causal (sdpa's is_causal)
# and transformers skips building a mask, including the packed-sequence check whose
# `.all()` waits for the device in every forward (and cannot run on meta tensors).
ATTENTION = "dtlab_causal_sdpa"
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
        _CONFIGS[key] = _load_config(m, dict(m.hf.config or {}))
    return _CONFIGS[key]


def _load_config(m: Any, fields: dict[str, Any]) -> Any:
    t = require_transformers()
    path = m.hf.path
    if path is not None:
        model_type = fields.pop("model_type", None)  # the directory's config.json names it
        if Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"model.hf.path '{path}' is a file; fix: give the directory that "
                              "holds config.json and the weights")
        if Path(path).is_dir():
            hf_check.check_file_type(path, t.CONFIG_MAPPING)
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
        hf_check.check_file_fields(cfg, path)
    else:
        model_type = fields.pop("model_type")
        if model_type not in t.CONFIG_MAPPING:
            raise ConfigError(f"model.hf.config.model_type={model_type} is not a model type "
                              "transformers knows; fix: e.g. llama, gpt2, qwen2, mistral")
        cfg = _strict(lambda: t.AutoConfig.for_model(model_type, **fields), "model.hf.config")
    _check_fields(cfg, fields)
    return cfg


def max_positions(config: Any) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def check(m: Any, thorough: bool = True) -> None:
    """Before any rank starts: the config loads with sizes that fit together, the model is a
    causal LM, the sequence fits its positions, and (`thorough`) it builds on the meta device and
    model.hf.path's weights fit it (dtlab/models/hf_check.py)."""
    config = hf_config(m)
    t = require_transformers()
    if type(config) not in t.AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"model.hf: {type(config).__name__} has no causal-LM head in "
                          "transformers; fix: use a decoder-only model (Llama, GPT-2, Qwen, ...)")
    hf_check.check_causal(m, config)
    hf_check.check_sizes(m, config)
    hf_check.check_activations(m, config, t)
    hf_check.check_kinds(m, config)
    limit = max_positions(config)
    if limit is not None and m.block_size > limit:
        raise ConfigError(f"model.block_size={m.block_size} exceeds the model's {limit} "
                          f"positions; fix: set model.block_size to at most {limit}")
    if thorough:
        hf_check.check_builds(m, config, t, ATTENTION)
        if m.hf.path is not None:
            hf_check.check_weights(m, config, t, lambda fields: _load_config(m, fields))


class HFCausalLM(nn.Module):
    """A transformers causal LM with dtlab's model interface."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits

    def blocks(self) -> list[nn.Module]:
        names = set(getattr(self.lm, "_no_split_modules", None) or ())
        found = [m for m in self.lm.modules() if type(m).__name__ in names]
        if not found:
            raise ConfigError(f"{type(self.lm).__name__} declares no decoder-layer class "
                              "(_no_split_modules), so dtlab cannot find its blocks; fix: use a "
                              "model whose transformers class declares one (Llama, GPT-2, Qwen)")
        return found

    @property
    def config(self) -> Any:
        return self.lm.config


def build(m: Any) -> HFCausalLM:
    """The model of an HFConfig: its weights from `path`, or initialised from the current seed;
    shapes only under torch.device("meta")."""
    t = require_transformers()
    check(m, thorough=False)  # the launcher did the rest (check_model)
    config, dtype = hf_config(m), DTYPES[m.hf.dtype]
    on_meta = torch.empty(0).device.type == "meta"
    if m.hf.path is not None and not on_meta:
        from safetensors import SafetensorError

        try:  # the files changed since the launcher checked them (check_model)
            lm = t.AutoModelForCausalLM.from_pretrained(m.hf.path, config=config, dtype=dtype,
                                                        attn_implementation=ATTENTION)
        except (OSError, SafetensorError, RuntimeError) as e:
            raise ConfigError(f"model.hf.path '{m.hf.path}': its weights cannot be loaded "
                              f"({str(e).splitlines()[0][:120]}); fix: point it at a complete "
                              "model directory (config.json + *.safetensors)") from None
    else:
        lm = t.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    lm.train()  # from_pretrained returns it in eval mode (dropout off)
    return HFCausalLM(lm)


def to_hf(m: Any, named: Any) -> tuple[dict[str, Any], Any]:
    """`dtlab export --format hf` of a model.name=hf checkpoint: its own config.json and its
    tensors under the transformers names (`lm.` dropped), in model order; a tied head is left to
    from_pretrained, as save_pretrained leaves it."""
    t = require_transformers("--format hf of a model.name=hf checkpoint")
    config = hf_config(m)
    cls = t.AutoModelForCausalLM._model_mapping[type(config)]
    tied = getattr(config, "tie_word_embeddings", False)
    out = {**config.to_dict(), "architectures": [cls.__name__],
           "dtype": str(named[next(iter(named))].dtype).removeprefix("torch.")}
    names = [k for k in named if not (tied and k == "lm.lm_head.weight")]
    return out, ((k.removeprefix("lm."), named[k]) for k in names)
