"""Hugging Face causal LMs (model.name=hf): a tiny Llama and a tiny GPT-2 built from configs,
trained by every data-parallel strategy at 2 ranks with loss and parameter parity against
single; weights from a local directory; activation checkpointing; the one-line refusals; the
estimate of Llama-3-8B's config without its weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import dtlab, fast_launches, max_rel_dev, needs, step_losses, train

from dtlab.cli.compare import param_deviation
from dtlab.config import load_config
from dtlab.errors import ConfigError

pytestmark = needs("transformers", "hf")

STEPS = 8
TOL = 1e-4  # as for dtlab's GPT (test_model_parallel.py)
LLAMA = ["model.name=hf", "model.hf.config.model_type=llama", "model.hf.config.vocab_size=128",
         "model.hf.config.hidden_size=64", "model.hf.config.intermediate_size=128",
         "model.hf.config.num_hidden_layers=2", "model.hf.config.num_attention_heads=4",
         "model.hf.config.num_key_value_heads=2", "model.hf.config.max_position_embeddings=64"]
GPT2 = ["model.name=hf", "model.hf.config.model_type=gpt2", "model.hf.config.vocab_size=128",
        "model.hf.config.n_embd=64", "model.hf.config.n_layer=2", "model.hf.config.n_head=4",
        "model.hf.config.n_positions=64", "model.hf.config.resid_pdrop=0",
        "model.hf.config.embd_pdrop=0", "model.hf.config.attn_pdrop=0"]
TRAIN = ["model.block_size=32", "data.synthetic.train_samples=256", "data.synthetic.val_samples=32",
         "train.global_batch_size=8", f"train.max_steps={STEPS}", "train.lr=0.1",
         "train.warmup_steps=2", "train.grad_clip=1.0"]
STRATEGIES = ["ddp", "fsdp", "fsdp1", "zero1", "hsdp"]
if "deepspeed" in sys.modules or __import__("importlib").util.find_spec("deepspeed"):
    STRATEGIES.append("deepspeed:3")


def compare(out: Path, model: list[str]) -> Path:
    with fast_launches():
        proc = dtlab("compare", "--strategies", ",".join(["single", *STRATEGIES]),
                     "--nproc-per-node", "2", "--verify", "--tolerance", str(TOL), "--out",
                     str(out), *model, *TRAIN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"verify passed: {STEPS} steps vs single" in proc.stdout
    return out


@pytest.fixture(scope="module")
def llama(session_dir: Path) -> Path:
    return compare(session_dir / "hf-llama", LLAMA)


@pytest.fixture(scope="module")
def gpt2(session_dir: Path) -> Path:
    return compare(session_dir / "hf-gpt2", GPT2)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_every_data_parallel_strategy_matches_single(model: str,
                                                     request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(model)
    ref = step_losses(runs / "single")
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.05  # it trained
    for spec in STRATEGIES:
        run = runs / spec.replace(":", "-")
        assert max_rel_dev(step_losses(run), ref) < TOL, spec
        # the same keys as single's (lm.<transformers name>), gathered from every shard
        assert param_deviation(run / "model.safetensors", runs / "single" / "model.safetensors") < TOL
    fsdp = json.loads((runs / "fsdp" / "summary.json").read_text())
    single = json.loads((runs / "single" / "summary.json").read_text())
    assert fsdp["n_params"] == single["n_params"]
    # each rank holds half of every sharded parameter (dim 0 of 128 rows or columns, even)
    assert fsdp["memory_per_rank"]["param_bytes"] == [single["n_params"] * 2] * 2


def test_activation_checkpointing_keeps_the_losses(llama: Path, tmp_path: Path) -> None:
    s = train(tmp_path / "ac", *LLAMA, *TRAIN, "strategy.name=fsdp",
              "train.activation_checkpointing=full", nproc=2)
    assert s["hardware_flops_per_step"] > s["flops_per_step"]  # the blocks' forwards, twice
    assert max_rel_dev(step_losses(tmp_path / "ac"), step_losses(llama / "fsdp")) < 1e-6


def test_weights_come_from_a_local_directory(tmp_path: Path) -> None:
    """model.hf.path: the directory's weights, not a fresh initialisation."""
    import transformers

    from dtlab.data import spec_for
    from dtlab.models import build_model
    from dtlab.models.hf import hf_config

    torch.manual_seed(7)
    saved = transformers.AutoModelForCausalLM.from_config(hf_config(load_config(None, LLAMA).model))
    saved.save_pretrained(tmp_path / "llama")
    cfg = load_config(None, ["model.name=hf", f"model.hf.path={tmp_path / 'llama'}", *TRAIN])
    model = build_model(cfg.model, spec_for(cfg))
    assert cfg.model.vocab_size == 128 and len(model.blocks()) == 2
    x = torch.randint(0, 128, (2, 32))
    saved.eval()
    model.eval()
    assert (model(x) - saved(x).logits).abs().max() < 1e-5
    s = train(tmp_path / "run", f"model.hf.path={tmp_path / 'llama'}", "model.name=hf", *TRAIN)
    assert s["steps"] == STEPS


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.name=hf"], "model.name=hf needs model.hf.path (a model directory) or "
                        "model.hf.config with a model_type"),
    ([*LLAMA, "model.hf.config.hidden_sise=64"],
     "model.hf.config.hidden_sise is not a field of LlamaConfig; fix: remove it (did you mean "
     "'hidden_size'?)"),
    ([*LLAMA, "model.hf.config.vocab_size=many"],
     "model.hf.config.vocab_size=many: Field 'vocab_size' expected int, got str; fix: give it "
     "a value of that type"),
    (["model.name=hf", "model.hf.config.model_type=llamma"],
     "model.hf.config.model_type=llamma is not a model type transformers knows"),
    ([*LLAMA, "model.block_size=65"],
     "model.block_size=65 exceeds the model's 64 positions; fix: set model.block_size to at "
     "most 64"),
    (["model.name=hf", "model.hf.path=missing/model"], "model.hf.path 'missing/model' is no local "
     "directory, and the hub is unreachable or has no such model"),
    ([*LLAMA, "strategy.name=cp"], "strategy.name=cp splits a GPT's layers, not model.name=hf"),
])
def test_bad_models_are_one_line(overrides: list[str], message: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # no hub here: offline answers at once (HF_HUB_OFFLINE is read when the hub is imported)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    proc = dtlab("train", *overrides, f"run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_without_transformers_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlab.config import transformers_config
    from dtlab.models import hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    monkeypatch.setattr(transformers_config, "_CONFIGS", {})
    with pytest.raises(ConfigError, match=r"^model.name=hf needs the transformers package; "
                                          r"fix: pip install 'dtlab\[hf\]'$"):
        hf.check(load_config(None, LLAMA).model)


def test_llama3_8b_is_estimated_from_its_config(tmp_path: Path) -> None:
    """Llama-3-8B's published config, no weights: 8.03B parameters (embedding and head untied,
    128,256 x 4,096 each; 32 layers of 218,112,000) and the state bytes each layout implies."""
    config = {"model": {"name": "hf", "block_size": 8192, "hf": {"config": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}}},
        "train": {"optimizer": "adamw", "precision": "bf16"}}
    (tmp_path / "llama3.yaml").write_text(json.dumps(config))
    proc = dtlab("estimate", "--config", str(tmp_path / "llama3.yaml"), "--world-size", "8",
                 "--strategies", "ddp,fsdp,zero1,deepspeed:3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # GQA: 8 kv heads
    n = 2 * 128256 * 4096 + 32 * block + 4096
    assert out["setup"]["n_params"] == n == 8_030_261_248
    rows = {r["strategy"]: r for r in out["rows"]}
    gb = n * 4 / 8  # fp32 parameters, AdamW's two fp32 moments: sharded over 8 ranks
    assert rows["ddp"]["params"] == pytest.approx(n * 4) and rows["ddp"]["optimizer"] == pytest.approx(8 * n)
    assert rows["fsdp"]["params"] == pytest.approx(gb, rel=1e-3)
    assert rows["zero1"]["optimizer"] == pytest.approx(2 * gb, rel=1e-3)
    assert rows["deepspeed:3"]["state"] == pytest.approx(16 * n / 8, rel=1e-3)


def test_export_loads_in_transformers_and_trains_again(tmp_path: Path) -> None:
    """A model.name=hf checkpoint exported with --format hf: transformers loads it with its own
    class and computes the checkpoint's logits; model.hf.path pointing at it trains on from
    those weights (its first loss is the checkpoint's next one)."""
    import transformers

    from dtlab.text.export import checkpoint_model

    train(tmp_path / "run", *LLAMA, *TRAIN, "train.max_steps=4", "train.checkpoint_every=4")
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    proc = dtlab("export", str(ckpt), "--format", "hf", "-o", str(tmp_path / "export"))
    assert proc.returncode == 0, proc.stderr
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", output_loading_info=True)
    assert type(loaded).__name__ == "LlamaForCausalLM" and not any(info.values()), info
    _, model = checkpoint_model(ckpt)
    x = torch.randint(0, 128, (2, 32))
    model.eval()
    assert (loaded.eval()(x).logits - model(x)).abs().max() < 1e-5
    s = train(tmp_path / "again", "model.name=hf", f"model.hf.path={tmp_path / 'export'}", *TRAIN,
              "train.max_steps=1", "train.lr=1e-9", "data.synthetic.train_samples=8")
    assert s["final_train_loss"] < step_losses(tmp_path / "run")[0] - 0.05  # not from scratch


def test_prepare_train_sample_a_llama(tmp_path: Path) -> None:
    """Text the test writes -> `dtlab prepare` (bytes) -> a tiny Llama -> `dtlab sample`."""
    from test_text import WORDS, text

    (tmp_path / "notes.txt").write_text(text(300))
    assert dtlab("prepare", "notes.txt", "--out", "data", cwd=tmp_path).returncode == 0
    llama = [o for o in LLAMA if "vocab_size" not in o]
    proc = dtlab("train", *llama, "model.hf.config.vocab_size=200", "data.name=tokens",
                 f"data.dir={tmp_path / 'data'}", f"run.dir={tmp_path / 'r0'}")
    assert proc.returncode == 2 and ("but model.hf.config.vocab_size=200; fix: set "
                                     "model.hf.config.vocab_size to at least 256") in proc.stderr
    s = train(tmp_path / "run", *llama, "model.hf.config.vocab_size=256", "data.name=tokens",
              f"data.dir={tmp_path / 'data'}", "model.block_size=32", "train.global_batch_size=16",
              "train.optimizer=adamw", "train.lr=0.01", "train.max_steps=30",
              "train.warmup_steps=0", "run.save_model=true")
    assert s["final_train_loss"] < 3.0  # ln 256 = 5.5 at the start: it learned the letters
    out = dtlab("sample", str(tmp_path / "run"), "--prompt", "the ", "--tokens", "40")
    assert out.returncode == 0, out.stderr
    new = out.stdout[len("the "):]
    assert out.stdout.startswith("the ") and len(new) >= 20
    assert sum(c in set("".join(WORDS) + " \n") for c in new) >= 0.8 * len(new), new


def test_advice_without_an_activation_model_says_so() -> None:
    proc = dtlab("advise", "--config", "configs/llama3_8b.yaml", "--gpus", "8", "--gpu-memory",
                 "80", cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "(activations of model.name=hf are not modelled: state only (dtlab train))" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].endswith(
        "; activations NOT included (not modelled for this model): measure a step before "
        "relying on it.")


def test_the_estimate_measures_what_the_runs_hold(llama: Path) -> None:
    """`dtlab estimate --config` on an hf model: its torch strategies' state bytes measured
    under the fake backend, equal to what the 2-rank runs held."""
    proc = dtlab("estimate", "--world-size", "2", "--strategies", "ddp,fsdp,zero1", "--json",
                 *LLAMA, *TRAIN, "--config", str(llama / "single" / "config.yaml"))
    assert proc.returncode == 0, proc.stderr
    rows = {r["strategy"]: r for r in json.loads(proc.stdout)["rows"]}
    for spec in ("ddp", "fsdp", "zero1"):
        held = json.loads((llama / spec / "summary.json").read_text())["memory_per_rank"]
        assert rows[spec]["source"].startswith("measured"), rows[spec]["source"]
        for kind in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert [r[kind] for r in rows[spec]["per_rank"]] == held[kind], (spec, kind)


def test_bf16_parameters_hold_two_bytes_each(tmp_path: Path) -> None:
    s = train(tmp_path / "bf16", *LLAMA, *TRAIN, "model.hf.dtype=bf16", "train.max_steps=2")
    mem = s["memory_per_rank"]
    assert mem["param_bytes"] == mem["grad_bytes"] == [2 * s["n_params"]]
    assert mem["optim_bytes"] == [2 * s["n_params"]]  # SGD momentum, in the parameters' dtype
    assert 0 < s["final_train_loss"] < 10
