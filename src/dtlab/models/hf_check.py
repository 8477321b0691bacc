"""What `model.name=hf` checks before any rank starts, beyond "the config loads" (dtlab/models/hf.py):

- config.json: an object naming a model type transformers knows, without misspelt fields
  (transformers keeps any key as an attribute, so a typo would silently leave the default);
- the values: sizes the user set are positive, key/value heads divide the attention heads,
  activations are ones transformers knows, no text where the config has a number (fields
  transformers converts, such as rope_theta, escape its own type checks), and the model builds
  on the meta device (what only the model's code rejects; heads that do not divide the width
  are the config's or the layers' own check);
- the model is causal: an encoder (BERT and its family, `is_decoder: false`) has an LM head in
  transformers but attention that sees the whole sequence, so it would train on the future;
- the weights of `model.hf.path`: present (every shard an index lists), complete safetensors, and
  every tensor the model expects there with its shape. This is transformers' own loading done on
  the meta device (the files' headers are read, never their data), so its renames and tied
  weights are honoured; a config.json whose model_type does not match its weights, or an
  override of a shape, would otherwise start from random weights without a word.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from dtlab.config.transformers_config import LOADING
from dtlab.errors import ConfigError

# Sizes that must be positive where a config has them (under transformers' canonical names,
# which attribute_map translates for GPT-2's n_embd and the like).
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")


def own_name(cfg: Any, name: str) -> str:
    """A field as the config's own class names it (GPT-2: n_embd for hidden_size)."""
    return getattr(type(cfg), "attribute_map", {}).get(name, name)


def source(m: Any, field: str | None = None) -> str:
    """Where a field's value came from, as the user wrote it: an override, or config.json."""
    overrides = m.hf.config or {}
    if m.hf.path is None or (field is not None and field in overrides):
        return f"model.hf.config.{field}" if field else "model.hf.config"
    return f"model.hf.path '{m.hf.path}': config.json" + (f"'s {field}" if field else "")


def where_to_fix(m: Any, field: str) -> str:
    if m.hf.path is None or field in (m.hf.config or {}):
        return ""
    return f" in {Path(m.hf.path) / 'config.json'}"


def field(cfg: Any, name: str) -> Any:
    """cfg.name, None where the config has none (or only per layer, as Gemma 4's head_dim)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attributes raise their own error
        return None


def check_sizes(m: Any, cfg: Any) -> None:
    """Sizes set to zero or less (a default of -1 is the class's own "unlimited": left alone);
    key/value heads dividing the attention heads (the width is the model's own check:
    transformers' config validation, or its layers when built, check_builds)."""
    defaults = type(cfg)()
    for name in SIZES:
        value = field(cfg, name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0 \
                and value != field(defaults, name):
            own = own_name(cfg, name)
            raise ConfigError(f"{source(m, own)}={value}: a size must be at least 1; fix: set "
                              f"{own} to a positive number{where_to_fix(m, own)}")
    heads, kv = field(cfg, "num_attention_heads"), field(cfg, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise ConfigError(f"{source(m, 'num_key_value_heads')}={kv} does not divide "
                          f"num_attention_heads={heads}; fix: choose num_key_value_heads among "
                          f"the divisors of {heads}{where_to_fix(m, 'num_key_value_heads')} "
                          "(equal to it for plain multi-head attention)")


def check_activations(m: Any, cfg: Any, transformers: Any) -> None:
    """Activation names transformers can look up (a wrong one fails only when the model is built)."""
    from transformers.activations import ACT2FN

    for name, value in cfg.to_dict().items():
        if (name.endswith("_act") or name in ("activation_function", "hidden_activation")) \
                and isinstance(value, str) and value not in ACT2FN:
            close = difflib.get_close_matches(value, sorted(ACT2FN), n=1)
            hint = f"did you mean {close[0]}?" if close else "e.g. silu, gelu, relu"
            raise ConfigError(f"{source(m, name)}={value!r} is not an activation transformers "
                              f"knows; fix: name one it does ({hint}){where_to_fix(m, name)}")


def check_kinds(m: Any, cfg: Any) -> None:
    """No text where the config class has a number (also inside its dicts: rope_parameters holds
    rope_theta): fields that transformers converts are not type-checked by it."""
    defaults = type(cfg)().to_dict()

    def numeric(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for name, value in cfg.to_dict().items():
        default = defaults.get(name)
        pairs = [(name, default, value)]
        if isinstance(default, dict) and isinstance(value, dict):
            pairs = [(k, default.get(k), v) for k, v in value.items()]
        for key, want, got in pairs:
            if numeric(want) and isinstance(got, str):  # (a list is fine: eos_token_id)
                raise ConfigError(f"{source(m, key)}={got!r}: {type(cfg).__name__}'s {key} is a "
                                  f"number; fix: give it one{where_to_fix(m, key)}")


def check_builds(m: Any, cfg: Any, transformers: Any, attention: str) -> None:
    """The model builds on the meta device (no memory; ~0.1 s for an 8B Llama): what only the
    model's own code rejects (an attention it does not support) is one line here, not a
    traceback on every rank. (No forward: on meta, mixture-of-experts layers take kernels that
    they would not take on a real device.)"""
    import torch

    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    except Exception as e:  # noqa: BLE001 - whatever the model's code raises, as one line
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else '?'}"
        given = sorted(set(m.hf.config or {}) - {"model_type"})
        among = f" (given: {', '.join(given)})" if given else \
            f" in {Path(m.hf.path) / 'config.json'}" if m.hf.path else ""
        raise ConfigError(f"{source(m)}: transformers cannot build "
                          f"{type(cfg).__name__.removesuffix('Config')} from these fields "
                          f"({why}); fix: correct the field behind it{among}, or use another "
                          "model") from None


def check_causal(m: Any, cfg: Any) -> None:
    """Configs of the encoder families carry `is_decoder`; false means attention in both
    directions (the decoder-only families have no such field: they are causal)."""
    if getattr(cfg, "is_decoder", True) is False:
        raise ConfigError(f"{source(m)}: model_type={cfg.model_type} is an encoder (is_decoder: "
                          "false), whose attention sees the tokens it predicts; fix: use a "
                          "decoder-only model (Llama, GPT-2, Qwen, Mistral, ...)")


def check_weights(m: Any, cfg: Any, transformers: Any, load_config: Any) -> None:
    """`model.hf.path`'s weights: present, readable, and each tensor the model needs there with
    its shape. `load_config(fields)` is the directory's config with those overrides."""
    path = Path(m.hf.path)
    if not path.is_dir():
        return  # a hub id: transformers downloads and checks it
    if not any((path / name).is_file() for name in WEIGHTS):
        raise ConfigError(f"model.hf.path '{path}' holds no weights (model.safetensors); fix: "
                          "point it at a directory with its weights (e.g. `dtlab export --format "
                          "hf`), or for random weights give its fields as model.hf.config")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"model.hf.path: {index} is not an index of shards (an object with "
                              "a weight_map); fix: write it again with the shards "
                              "(`dtlab export --format hf`)") from None
        for shard in shards:
            if not (path / shard).is_file():
                raise ConfigError(f"model.hf.path: {index} lists the shard {shard}, which is not "
                                  f"in {path}; fix: copy every shard of the model there")
    from safetensors import SafetensorError, safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):  # reads and checks the header only
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model.hf.path: '{file}' is not a complete safetensors file "
                              f"({str(e).splitlines()[0][:100]}); fix: write it again (`dtlab "
                              "export --format hf`) or copy it again from its source") from None
    if not any(path.glob("*.safetensors")):
        return  # pytorch_model.bin: read by transformers' restricted unpickler in the ranks only
    problem = weight_problem(path, cfg, transformers)
    if problem is None:
        return
    overrides = sorted(m.hf.config or {})
    if overrides and weight_problem(path, load_config({}), transformers) is None:
        raise ConfigError(f"model.hf.config override(s) {', '.join(overrides)} change the shapes "
                          f"of the weights in model.hf.path '{path}' ({problem}); fix: remove "
                          "them (with a path, overrides may change only what keeps the weights' "
                          "shapes: dropout, rope scaling, ...)")
    raise ConfigError(f"model.hf.path '{path}': its weights do not fit its config.json "
                      f"(model_type={cfg.model_type}: {problem}); fix: use the config.json "
                      "written with these weights (its model_type and sizes)")


def weight_problem(path: Path, cfg: Any, transformers: Any) -> str | None:
    """What transformers would initialise randomly or fail to load, from the files' headers."""
    auto = transformers.AutoModelForCausalLM
    try:
        _, info = auto.from_pretrained(str(path), config=cfg, device_map="meta",
                                       output_loading_info=True, ignore_mismatched_sizes=True,
                                       **LOADING)
    except (OSError, ValueError, RuntimeError) as e:
        return f"transformers cannot load them: {str(e).splitlines()[0][:120]}"
    missing, mismatched = sorted(info["missing_keys"]), sorted(info["mismatched_keys"])
    if mismatched:
        name, in_file, in_model = mismatched[0]
        return (f"{len(mismatched)} tensor(s) of another shape, e.g. '{name}' "
                f"{list(in_file)} in the files, {list(in_model)} in the model")
    if missing:
        unexpected = sorted(info["unexpected_keys"])
        extra = f", and {len(unexpected)} it has no place for (e.g. '{unexpected[0]}')" \
            if unexpected else ""
        return f"{len(missing)} tensor(s) the model needs are missing (e.g. '{missing[0]}'){extra}"
    return None
