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
from conftest import dtlab, fast_launches, max_rel_dev, needs, step_losses, train

from dtlab.cli.compare import param_deviation

pytestmark = needs("transformers", "hf")

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


def test_fsdp_tp_matches_single(runs: Path, tmp_path: Path) -> None:
    """A tiny Llama under fsdp_tp on a 2x2 mesh (4 ranks) has single's losses and parameters."""
    with fast_launches():
        s = train(tmp_path / "fsdp_tp", *LLAMA, *TRAIN, "strategy.name=fsdp_tp",
                  "strategy.tp.degree=2", nproc=4)
    assert s["strategy_options"]["mesh"] == {"dp": 2, "tp": 2}
    assert max_rel_dev(step_losses(tmp_path / "fsdp_tp"), step_losses(runs / "single")) < TOL
    assert param_deviation(tmp_path / "fsdp_tp" / "model.safetensors",
                           runs / "single" / "model.safetensors") < TOL


def _with(**fields: object) -> list[str]:
    """LLAMA with these config fields changed."""
    keep = [a for a in LLAMA if a.split("=")[0].removeprefix("model.hf.config.") not in fields]
    return keep + [f"model.hf.config.{k}={v}" for k, v in fields.items()]


@pytest.mark.parametrize(("overrides", "message"), [
    (_with(hidden_size=48, num_attention_heads=3, num_key_value_heads=1),
     "model.hf.config.num_attention_heads=3 is not divisible by the tensor-parallel degree 2"),
    (_with(num_key_value_heads=1),
     "model.hf.config.num_key_value_heads=1 is not divisible by the tensor-parallel degree 2"),
    (_with(intermediate_size=129),
     "model.hf.config.intermediate_size=129 is not divisible by the tensor-parallel degree 2"),
    (_with(tie_word_embeddings="true"),
     "tie_word_embeddings with strategy.name=tp is not supported"),
    ([*_with(model_type="qwen3"), "model.hf.config.head_dim=16"],
     "strategy.name=tp has no tensor-parallel plan for Qwen3 (its parameter "
     "model.layers.0.self_attn.q_norm.weight is not a Llama-style projection or norm)"),
    ([*LLAMA, "model.block_size=33"],
     "model.block_size=33 is not divisible by the tensor-parallel degree 2"),
])
def test_what_the_plan_cannot_split_is_one_line(overrides: list[str], message: str,
                                                tmp_path: Path) -> None:
    """A Llama that tp cannot split on 2 ranks is refused in one line, exit 2, before any rank starts."""
    proc = dtlab("train", "--nproc-per-node", "2", "model.block_size=32", *overrides,
                 "strategy.name=tp", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before any rank started


def test_pipeline_parallelism_refuses_a_tied_head(tmp_path: Path) -> None:
    """pp splits a Llama's layers into stages; the first holds the embedding, the last the head,
    so one weight shared by both is refused in one line."""
    proc = dtlab("train", "--nproc-per-node", "2", *LLAMA, "strategy.name=pp",
                 "model.hf.config.tie_word_embeddings=true", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    assert ("tie_word_embeddings with strategy.name=pp is not supported" in proc.stderr), proc.stderr


def test_estimate_of_llama3_8b_under_fsdp_tp_is_one_line() -> None:
    """The fake-backend estimate of Llama-3-8B under fsdp_tp@8x8 on 64 ranks answers in one line."""
    proc = dtlab("estimate", "--config", "configs/llama3_8b.yaml", "--world-size", "64",
                 "--strategies", "fsdp_tp@8x8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "'fsdp_tp@8x8'" in lines[0], proc.stderr
