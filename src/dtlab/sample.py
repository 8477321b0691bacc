"""`dtlab sample SOURCE --prompt TEXT --tokens N`: text from a trained language model (dtlab's GPT
or a Hugging Face model, model.name=hf), to see what it learned.

SOURCE is a run directory (its `model.safetensors` when the run saved one, else its newest
checkpoint that verifies) or a checkpoint directory. The prompt is encoded, and the output
decoded, with the tokenizer its token data was prepared with (the data directory's meta.json:
`dtlab prepare`); without one (synthetic tokens) the prompt is a list of token ids and the output
is printed as ids. Sampling: temperature and top-k, on the CPU, from a seeded generator (the same
command prints the same text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlab import tokenizer as tokenizers
from dtlab.errors import DtlabError


def load(source: Path) -> tuple[Any, Any]:
    """(config, model in eval mode) of a run or checkpoint directory."""
    from dtlab.checkpoint import newest_verified
    from dtlab.config import LANGUAGE_MODELS, load_config
    from dtlab.data import spec_for
    from dtlab.export import checkpoint_model
    from dtlab.models import build_model

    if (source / "dtlab-checkpoint.json").is_file():
        cfg, model = checkpoint_model(source)
    elif (source / "config.yaml").is_file():
        cfg = load_config(source / "config.yaml")
        if (source / "model.safetensors").is_file():
            model = build_model(cfg.model, spec_for(cfg), cfg.train.lora)
            load_weights(model, source / "model.safetensors")
        elif (checkpoint := newest_verified(source)) is not None:
            cfg, model = checkpoint_model(checkpoint)
        else:
            raise DtlabError(f"{source} holds no model.safetensors and no checkpoint; fix: train "
                             "with run.save_model=true or train.checkpoint_every=N")
    else:
        raise DtlabError(f"{source} is neither a run directory (config.yaml) nor a checkpoint "
                         "(dtlab-checkpoint.json); fix: pass RUN_DIR or RUN_DIR/checkpoints/step_N")
    if cfg.model.name not in LANGUAGE_MODELS:
        raise DtlabError(f"{source} holds a {cfg.model.name} model, which does not generate text; "
                         "fix: sample from a run of model.name=gpt or hf")
    return cfg, model.eval()


def load_weights(model: Any, file: Path) -> None:
    """A run's model.safetensors into `model`: a file cut short, corrupt, or of another model
    is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fix = ("fix: sample from a checkpoint instead (dtlab sample RUN_DIR/checkpoints/step_N), or "
           "train again with run.save_model=true")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise DtlabError(f"'{file}' is not a complete safetensors file "
                         f"({str(e).splitlines()[0][:100]}); {fix}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    shapes = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    extra = sorted(set(tensors) - set(expected))
    if missing or shapes or extra:
        why = (f"{len(missing)} tensor(s) missing, e.g. '{missing[0]}'" if missing else
               f"'{shapes[0]}' is {list(tensors[shapes[0]].shape)} in the file, "
               f"{list(expected[shapes[0]].shape)} in the model" if shapes else
               f"{len(extra)} tensor(s) the model has no place for, e.g. '{extra[0]}'")
        raise DtlabError(f"'{file}' does not hold the weights of the model in its config.yaml "
                         f"({why}); {fix}")
    model.load_state_dict(tensors)


def prompt_ids(cfg: Any, tok: tokenizers.Tokenizer | None, prompt: str) -> list[int]:
    if tok is not None:
        ids = tok.encode(prompt)
    else:
        try:
            ids = [int(x) for x in prompt.replace(",", " ").split()]
        except ValueError:
            raise DtlabError(f"--prompt {prompt!r}: this run trained on data without a tokenizer "
                             "(synthetic tokens), so the prompt is token ids; fix: --prompt "
                             "'1 2 3', or train on `dtlab prepare`d text") from None
    if not ids:
        raise DtlabError("--prompt is empty after encoding; fix: give at least one character")
    if max(ids) >= cfg.model.vocab_size:
        raise DtlabError(f"--prompt holds token id {max(ids)}, beyond the model's vocabulary of "
                         f"{cfg.model.vocab_size}; fix: use ids below it")
    return ids


def generate(model: Any, ids: list[int], tokens: int, block_size: int, temperature: float,
             top_k: int, seed: int) -> list[int]:
    """`tokens` new ids after `ids`: each from the softmax of the last position's logits over
    temperature, restricted to the top_k most likely (0 = all); temperature 0 = the most likely."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(seq[:, -block_size:])[0, -1].float()
            if temperature == 0:
                nxt = logits.argmax().view(1)
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    logits[logits < torch.topk(logits, top_k).values[-1]] = -float("inf")
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids):].tolist()


def sample(source: Path, prompt: str, tokens: int, temperature: float, top_k: int, seed: int,
           samples: int) -> list[str]:
    cfg, model = load(source)
    tok = tokenizers.from_meta(Path(cfg.data.dir)) if cfg.data.name == "tokens" else None
    ids = prompt_ids(cfg, tok, prompt)
    out = []
    for i in range(samples):
        new = generate(model, ids, tokens, cfg.model.block_size, temperature, top_k, seed + i)
        out.append(prompt + tok.decode(new) if tok is not None else " ".join(map(str, ids + new)))
    return out
