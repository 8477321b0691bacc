"""Inference across ranks: `dtlab sample --nproc-per-node 2 --inference tp|deepspeed --verify` on
real gloo ranks gives the logits (within 1e-5) and greedy tokens of one process, and the same
sampled text, for a tiny Hugging Face Llama (tp and DeepSpeed AutoTP) and dtlab's GPT (tp); it
says what it measured; what it cannot split is one line, exit 2, before any rank starts.

The models are built from their configs and saved as run directories (config.yaml and
model.safetensors, what `run.save_model=true` writes) without training: random weights exercise
every split as well as trained ones. The ranks start through tests/ranks.py (fast_launches)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import ranks
from conftest import dtlab, fast_launches, in_process, needs

from dtlab.text import sample_ranks

pytestmark = needs("transformers", "hf")

LLAMA = ["model.name=hf", "model.hf.config.model_type=llama", "model.hf.config.vocab_size=128",
         "model.hf.config.hidden_size=64", "model.hf.config.intermediate_size=128",
         "model.hf.config.num_hidden_layers=2", "model.hf.config.num_attention_heads=4",
         "model.hf.config.num_key_value_heads=2", "model.hf.config.max_position_embeddings=64",
         "model.hf.config.tie_word_embeddings=false", "model.block_size=32"]
GPT = ["model.name=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
       "model.block_size=32", "model.vocab_size=128"]
# an odd prompt length: sequence parallelism pads the context to a multiple of the ranks
ARGS = ["--prompt", "5 17 3", "--tokens", "6", "--seed", "7", "--samples", "2"]
VERIFY = re.compile(r"^dtlab: verify: 2-rank (\w+) logits differ from one process's by at most "
                    r"(\S+) \(over 6 greedy steps; tolerance 1e-05\); greedy tokens: 6 of 6 "
                    r"identical$", re.M)


def saved_run(run_dir: Path, overrides: list[str]) -> Path:
    """A run directory holding the config and the (untrained) weights of a model."""
    from safetensors.torch import save_file

    from dtlab.config import load_config, to_yaml
    from dtlab.data import spec_for
    from dtlab.models import build_model

    cfg = load_config(None, overrides)
    model = build_model(cfg.model, spec_for(cfg), cfg.train.lora)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(run_dir / "model.safetensors"))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sample-ranks")
    return {"llama": saved_run(root / "llama", LLAMA), "gpt": saved_run(root / "gpt", GPT)}


@pytest.fixture
def launches() -> Iterator[None]:
    """The ranks of `dtlab sample` start from tests/ranks.py's forkserver, running the worker's
    own entry point."""
    with fast_launches(), pytest.MonkeyPatch.context() as mp:
        mp.setitem(ranks.MAINS, sample_ranks.MODULE, sample_ranks.main)
        yield


def on_ranks_as_in_one_process(run: Path, inference: str) -> None:
    one = dtlab("sample", str(run), *ARGS)
    assert one.returncode == 0, one.stderr
    split = dtlab("sample", str(run), *ARGS, "--nproc-per-node", "2", "--inference", inference,
                  "--verify")
    assert split.returncode == 0, split.stdout[-2000:] + split.stderr[-3000:]
    assert split.stdout == one.stdout  # the same sampled text, nothing else (no library noise)
    assert split.stdout.count("\n---\n") == 1 and split.stdout.startswith("5 17 3 ")
    match = VERIFY.search(split.stderr)
    assert match and match[1] == inference, split.stderr
    assert float(match[2]) <= 1e-5
    said = split.stderr
    assert f"dtlab: {inference} on 2 ranks (cpu, gloo): time to first token " in said
    assert "(10 tokens after the first of each sample; no KV cache" in said
    weights = re.search(r"^dtlab: per rank: weights (\S+), (\S+) MiB; peak RSS", said, re.M)
    assert weights and weights[1] == weights[2], said


def test_tp_llama_on_two_ranks(runs: dict[str, Path], launches: None) -> None:
    """A tiny Llama split by torch tensor parallelism on 2 ranks samples the text of one process; its logits are within 1e-5 and its greedy tokens identical (--verify)."""
    on_ranks_as_in_one_process(runs["llama"], "tp")


def test_deepspeed_llama_on_two_ranks(runs: dict[str, Path], launches: None) -> None:
    """A tiny Llama split by DeepSpeed inference (AutoTP) on 2 ranks samples the text of one process; its logits are within 1e-5 and its greedy tokens identical (--verify)."""
    pytest.importorskip("deepspeed")
    on_ranks_as_in_one_process(runs["llama"], "deepspeed")


def test_tp_gpt_on_two_ranks(runs: dict[str, Path], launches: None) -> None:
    """dtlab's GPT split by torch tensor parallelism on 2 ranks samples the text of one process; its logits are within 1e-5 and its greedy tokens identical (--verify)."""
    on_ranks_as_in_one_process(runs["gpt"], "tp")


def refused(*args: str) -> str:
    proc = dtlab("sample", *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line, no traceback
    return proc.stderr.strip()


def test_what_cannot_be_split_is_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    """DeepSpeed for dtlab's GPT, a model whose sizes the ranks cannot split, a non-Llama model, more ranks than cores, a missing GPU, --inference, --device or --verify on one process, DeepSpeed's kernel injection without deepspeed, with --verify or without CUDA: one line each, exit 2, before any rank starts."""
    gpt, llama = str(runs["gpt"]), str(runs["llama"])
    assert refused(gpt, "--nproc-per-node", "2", "--inference", "deepspeed") == (
        "dtlab: error: --inference deepspeed cannot split dtlab's GPT (DeepSpeed's AutoTP refuses "
        "GPT-2-style blocks and its kernel injection has no CPU implementation); fix: "
        "--inference tp")
    odd = str(saved_run(tmp_path / "odd", [*GPT, "model.vocab_size=127"]))
    assert refused(odd, "--nproc-per-node", "2") == (
        "dtlab: error: model.vocab_size=127 is not divisible by --nproc-per-node 2 (heads, MLP "
        "width, vocabulary and context are split over the ranks); fix: sample in one process "
        "(drop --nproc-per-node)")
    gpt2 = str(saved_run(tmp_path / "gpt2", [
        "model.name=hf", "model.hf.config.model_type=gpt2", "model.hf.config.vocab_size=128",
        "model.hf.config.n_embd=32", "model.hf.config.n_layer=1", "model.hf.config.n_head=2",
        "model.hf.config.n_positions=32", "model.block_size=32"]))
    assert refused(gpt2, "--nproc-per-node", "2", "--inference", "deepspeed") == (
        "dtlab: error: --inference deepspeed has no tensor-parallel split for GPT2 (its parameter "
        "transformer.wte.weight is not a Llama-style projection or norm); fix: sample in one "
        "process (drop --nproc-per-node), or use a Llama-family model (Llama, Mistral, Qwen2) or "
        "dtlab's GPT with --inference tp")
    cores = os.cpu_count() or 1
    assert refused(llama, "--nproc-per-node", str(cores + 1)) == (
        f"dtlab: error: --nproc-per-node {cores + 1} is more than this machine's {cores} CPU "
        f"core(s) (each rank computes on its own); fix: --nproc-per-node {cores} or fewer")
    assert refused(llama, "--inference", "tp") == (
        "dtlab: error: --inference tp splits the model over ranks, and --nproc-per-node is 1; "
        "fix: --nproc-per-node 2 (or more), or drop --inference to sample in one process")
    assert refused(llama, "--nproc-per-node", "2", "--device", "cuda") == (  # no GPU in tests
        "dtlab: error: --device cuda, but no CUDA device is visible; fix: --device cpu")
    assert refused(llama, "--device", "cpu") == (
        "dtlab: error: --device cpu chooses where split ranks compute, and --nproc-per-node is 1 "
        "(one process samples on the CPU); fix: add --nproc-per-node 2, or drop --device")
    assert refused(llama, "--verify") == (
        "dtlab: error: --verify compares ranks that split the model with one process, and "
        "--nproc-per-node is 1; fix: add --nproc-per-node 2, or drop --verify")
    assert refused(llama, "--nproc-per-node", "2", "--kernel-inject") == (
        "dtlab: error: --kernel-inject is DeepSpeed's (its fused CUDA kernels); fix: add "
        "--inference deepspeed, or drop --kernel-inject")
    assert refused(llama, "--nproc-per-node", "2", "--inference", "deepspeed", "--kernel-inject",
                   "--verify") == (
        "dtlab: error: --verify compares with one float32 process to 1e-5, and --kernel-inject "
        "computes in fp16; fix: verify without --kernel-inject (AutoTP)")
    assert refused(gpt2, "--nproc-per-node", "2", "--inference", "deepspeed",
                   "--kernel-inject") == (  # no GPU in tests
        "dtlab: error: --kernel-inject runs DeepSpeed's fused CUDA kernels, and the ranks would "
        "compute on the CPU (no CUDA device is visible); fix: drop --kernel-inject (AutoTP splits "
        "Llama-family models on the CPU)")
    assert refused(llama, "--nproc-per-node", "2", "--prompt", "999") == (
        "dtlab: error: --prompt holds token id 999, beyond the model's vocabulary of 128; fix: "
        "use ids below it")


def test_verify_fails_in_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    """--verify exits 1 with one line giving both findings when the ranks' logits are off by more than 1e-5 or a greedy token differs."""
    from safetensors.torch import save_file

    from dtlab.text.sample import load

    _, model = load(runs["gpt"])
    ids = [5, 17, 3]
    tokens, logits = sample_ranks.greedy(model, ids, 4, 32)
    cases = [(tokens, logits, "dtlab: verify:", "0.0e+00", 4),
             (tokens, logits + 2e-5, "dtlab: error: --verify failed:", "2.0e-05", 4),
             ((tokens + 1) % 128, logits, "dtlab: error: --verify failed:", "0.0e+00", 0)]
    for i, (ranks_tokens, ranks_logits, head, diff, same) in enumerate(cases):
        file = tmp_path / f"greedy{i}.safetensors"
        save_file({"tokens": ranks_tokens, "logits": ranks_logits.contiguous()}, str(file))
        proc = in_process(lambda f=file: sample_ranks.verify(model, ids, 4, 32, f, "2-rank tp"))
        assert proc.returncode == (0 if i == 0 else 1)
        assert proc.stderr == (
            f"{head} 2-rank tp logits differ from one process's by at most {diff} (over 4 "
            f"greedy steps; tolerance 1e-05); greedy tokens: {same} of 4 identical\n"), proc.stderr
