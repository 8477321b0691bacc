"""`dtlab sample SOURCE --prompt TEXT --tokens N`: text from a trained language model (dtlab's GPT
or a Hugging Face model, model.name=hf), to see what it learned.

SOURCE is a run directory (its `model.safetensors` when the run saved one, else its newest
checkpoint that verifies) or a checkpoint directory. The prompt is encoded, and the output
decoded, with the tokenizer its token data was prepared with (the data directory's meta.json:
`dtlab prepare`); without one (synthetic tokens) the prompt is a list of token ids and the output
is printed as ids. Sampling: temperature and top-k, on the CPU, from a seeded generator (the same
command prints the same text). The text is written as it is generated, and the rate on stderr at
the end; --tokens is at most MAX_CONTEXTS x the model's context (block_size).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from dtlab.errors import DtlabError
from dtlab.text import tokenizer as tokenizers

# --tokens is bounded by this many of the model's contexts (block_size): past its context the
# model sees only the last block_size tokens, and a command asked for 100,000 tokens runs for
# an hour on a CPU
MAX_CONTEXTS = 10
DECODE_CONTEXT = 4  # ids decoded before the new one (see text_pieces)


def load(source: Path) -> tuple[Any, Any]:
    """(config, model in eval mode) of a run or checkpoint directory."""
    from dtlab.config import LANGUAGE_MODELS, load_config
    from dtlab.data import spec_for
    from dtlab.models import build_model
    from dtlab.run.checkpoint import newest_verified
    from dtlab.text.export import checkpoint_model

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


def check_tokens(tokens: int, prompt_len: int, block_size: int, note: bool = True) -> None:
    """Refuse more than MAX_CONTEXTS of the model's context (block_size) up front; say it when
    the text outgrows the context (each token is then drawn from the last block_size only)."""
    bound = MAX_CONTEXTS * block_size
    if tokens > bound:
        raise DtlabError(f"--tokens {tokens} is more than {MAX_CONTEXTS} x the model's context of "
                         f"{block_size} tokens; fix: --tokens {bound} or fewer (beyond its context "
                         f"the model sees only the last {block_size} tokens)")
    if note and prompt_len + tokens > block_size:
        print(f"dtlab: note: the prompt ({prompt_len}) and {tokens} new tokens outgrow the model's "
              f"context of {block_size}: each token is drawn from the last {block_size} (a sliding "
              "window)", file=sys.stderr, flush=True)


def generate(model: Any, ids: list[int], tokens: int, block_size: int, temperature: float,
             top_k: int, seed: int) -> Iterator[int]:
    """`tokens` new ids after `ids`, one at a time as drawn: each from the softmax of the last
    position's logits over temperature, restricted to the top_k most likely (0 = all);
    temperature 0 = the most likely."""
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
            yield int(nxt)


def text_pieces(tok: tokenizers.Tokenizer, new: Iterable[int]) -> Iterator[str]:
    """The decoded text of `new`, piece by piece as the ids arrive. A piece is held back while it
    ends in an incomplete character (a multi-byte letter split over ids), and each id is decoded
    after a few of the ids before it, so that a tokenizer that joins words (spaces) is right."""
    ids: list[int] = []
    start, shown = 0, ""  # ids[start:] decode to `shown` plus what is not yet printed
    for i in new:
        ids.append(i)
        text = tok.decode(ids[start:])
        if text.endswith("\ufffd"):
            continue
        yield text[len(shown):]
        start = max(start, len(ids) - DECODE_CONTEXT)
        shown = tok.decode(ids[start:])
    rest = tok.decode(ids[start:])[len(shown):]  # an incomplete character at the very end
    if rest:
        yield rest


def sample(source: Path, prompt: str, tokens: int, temperature: float, top_k: int, seed: int,
           samples: int, out: TextIO) -> tuple[int, float]:
    """Write `samples` texts to `out` as they are generated (separated by ---); returns the
    tokens generated and the seconds they took."""
    cfg, model = load(source)
    tok, ids = tokenizer_and_prompt(cfg, prompt, tokens)
    started = time.perf_counter()
    for i in range(samples):
        new = generate(model, ids, tokens, cfg.model.block_size, temperature, top_k, seed + i)
        write_sample(out, i, prompt, tok, ids, new)
    out.write("\n")
    out.flush()
    return samples * tokens, time.perf_counter() - started


def tokenizer_and_prompt(cfg: Any, prompt: str, tokens: int,
                         note: bool = True) -> tuple[tokenizers.Tokenizer | None, list[int]]:
    """The run's tokenizer (None: synthetic tokens, the prompt is ids) and the prompt's ids;
    --tokens checked against the model's context (`note`: say when the text outgrows it)."""
    tok = tokenizers.from_meta(Path(cfg.data.dir)) if cfg.data.name == "tokens" else None
    if cfg.data.name == "tokens" and tok is None:  # else its prompt would be taken as token ids
        raise DtlabError(f"the run trained on the token data in '{cfg.data.dir}', whose meta.json "
                         "(naming its tokenizer) is missing or unreadable; fix: put the data set "
                         "back there, or prepare it again there with dtlab prepare")
    ids = prompt_ids(cfg, tok, prompt)
    check_tokens(tokens, len(ids), cfg.model.block_size, note)
    return tok, ids


def write_sample(out: TextIO, index: int, prompt: str, tok: tokenizers.Tokenizer | None,
                 ids: list[int], new: Iterable[int]) -> None:
    """Sample number `index` (separated from the one before by ---): the prompt, then the new
    ids as text (or as ids without a tokenizer), written as they arrive."""
    if index:
        out.write("\n---\n")
    out.write(prompt if tok is not None else " ".join(map(str, ids)))
    for piece in text_pieces(tok, new) if tok is not None else (f" {t}" for t in new):
        out.write(piece)
        out.flush()
