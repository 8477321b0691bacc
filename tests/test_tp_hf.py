"""Tensor parallelism of Hugging Face Llama-family decoders (model.name=hf): a tiny Llama trained
under tp on 2 gloo ranks has single's losses and parameters; the Llama plan splits every
projection, so each rank holds half the weights; what the plan cannot split (heads, key/value
heads or MLP width not divisible by the degree, tied embeddings, an architecture it does not know)
is one line, exit 2, before any rank starts; the fake-backend estimate of Llama-3-8B under
fsdp_tp@8x8 answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dtlab, fast_launches, max_rel_dev, step_losses, train

from dtlab.cli.compare import param_deviation

pytest.importorskip("transformers")

STEPS = 3
TOL = 1e-4  # as for dtlab's GPT under tp (test_model_parallel.py)
LLAMA = ["model.name=hf", "model.hf.config.model_type=llama", "model.hf.config.vocab_size=128",
         "model.hf.config.hidden_size=64", "model.hf.config.intermediate_size=128",
         "model.hf.config.num_hidden_layers=2", "model.hf.config.num_attention_heads=4",
         "model.hf.config.num_key_value_heads=2", "model.hf.config.max_position_embeddings=64",
         "model.hf.config.tie_word_embeddings=false"]
TRAIN = ["model.block_size=32", "data.synthetic.train_samples=64", "data.synthetic.val_samples=16",
         "train.global_batch_size=8", f"train.max_steps={STEPS}", "train.lr=0.1",
         "train.warmup_steps=1", "train.grad_clip=1.0", "run.save_model=true"]


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    out = session_dir / "tp-hf"
    with fast_launches():
        single = train(out / "single", *LLAMA, *TRAIN, "strategy.name=single")
        tp = train(out / "tp", *LLAMA, *TRAIN, "strategy.name=tp", nproc=2)
    assert single["n_params"] == tp["n_params"]
    return out


def test_tp_matches_single(runs: Path) -> None:
    """A tiny Llama under tp on 2 ranks has single's per-step losses and final parameters."""
    ref = step_losses(runs / "single")
    assert len(ref) == STEPS
    assert max_rel_dev(step_losses(runs / "tp"), ref) < TOL
    # the same keys (lm.<transformers name>), gathered from both ranks' shards
    assert param_deviation(runs / "tp" / "model.safetensors",
                           runs / "single" / "model.safetensors") < TOL


def test_tp_splits_the_weights(runs: Path) -> None:
    """Under tp each rank holds half of every projection and embedding (norms are replicated)."""
    single = json.loads((runs / "single" / "summary.json").read_text())
    tp = json.loads((runs / "tp" / "summary.json").read_text())
    full = single["memory_per_rank"]["param_bytes"][0]
    norms = 4 * 64 * (2 * 2 + 1)  # fp32 weights of 2 norms per block and the final one
    assert tp["memory_per_rank"]["param_bytes"] == [(full - norms) // 2 + norms] * 2
    assert tp["strategy_options"]["mesh"] == {"dp": 1, "tp": 2}
