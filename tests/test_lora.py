"""LoRA fine-tuning (train.lora) of a tiny Hugging Face Llama: ddp and fsdp match single at 2
ranks, only the adapters train (their bytes are all the gradients and optimizer state hold), a
checkpoint resumes as the uninterrupted run goes on, and export folds the adapters in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import dtlab, fast_launches, max_rel_dev, needs, step_losses, train
from safetensors.torch import load_file

from dtlab.cli.compare import param_deviation
from dtlab.config import load_config
from dtlab.data import spec_for
from dtlab.models import build_model

pytestmark = needs("peft", "lora")
from test_hf import LLAMA, TOL, TRAIN  # noqa: E402

LORA = [*LLAMA, *TRAIN, "train.lora.rank=4", "train.lora.alpha=8",
        "train.lora.targets=[q_proj,v_proj]"]
# per layer: q_proj 64 -> 64 and v_proj 64 -> 32 (2 kv heads of 16), A: r x in, B: out x r
ADAPTERS = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    out = session_dir / "lora"
    with fast_launches():
        proc = dtlab("compare", "--strategies", "single,ddp,fsdp", "--nproc-per-node", "2",
                     "--verify", "--tolerance", str(TOL), "--out", str(out), *LORA)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_ddp_and_fsdp_match_single_and_train_only_the_adapters(runs: Path) -> None:
    ref = step_losses(runs / "single")
    assert ref[-1] < ref[0]  # it trained
    for spec in ("ddp", "fsdp"):
        assert max_rel_dev(step_losses(runs / spec), ref) < TOL
        assert param_deviation(runs / spec / "model.safetensors",
                               runs / "single" / "model.safetensors") < TOL
    cfg = load_config(None, LORA)
    torch.manual_seed(cfg.seed)
    start = build_model(cfg.model, spec_for(cfg), cfg.train.lora).state_dict()
    end = load_file(runs / "single" / "model.safetensors")
    assert end.keys() == start.keys()
    for k in start:  # the frozen weights end where they began, the adapters moved
        assert torch.equal(end[k], start[k]) == (".lora_" not in k), k
    mem = {s: json.loads((runs / s / "summary.json").read_text())["memory_per_rank"]
           for s in ("single", "ddp", "fsdp")}
    # fp32 gradients and SGD momentum of the adapters alone: whole on ddp, half on fsdp
    assert mem["single"]["grad_bytes"] == [4 * ADAPTERS]
    assert mem["ddp"]["grad_bytes"] == mem["ddp"]["optim_bytes"] == [4 * ADAPTERS] * 2
    assert mem["fsdp"]["grad_bytes"] == mem["fsdp"]["optim_bytes"] == [2 * ADAPTERS] * 2


def test_a_checkpoint_resumes_and_exports_merged(tmp_path: Path) -> None:
    const = ["train.schedule=constant", "train.warmup_steps=0"]
    train(tmp_path / "whole", *LORA, *const)
    whole = step_losses(tmp_path / "whole")
    train(tmp_path / "cut", *LORA, *const, "train.max_steps=4", "train.checkpoint_every=4")
    resumed = train(tmp_path / "cut", *LORA, *const)  # resume=auto: from step 4 on
    assert resumed["resumed_from"]["step"] == 4
    assert max_rel_dev(step_losses(tmp_path / "cut")[-4:], whole[-4:]) < 1e-6

    from dtlab.text.export import checkpoint_model

    ckpt = tmp_path / "cut" / "checkpoints" / "step_000004"
    proc = dtlab("export", str(ckpt), "-o", str(tmp_path / "merged.safetensors"))
    assert proc.returncode == 0, proc.stderr
    cfg, adapted = checkpoint_model(ckpt)
    plain = build_model(cfg.model, spec_for(cfg))
    plain.load_state_dict(load_file(tmp_path / "merged.safetensors"))  # the plain model's names
    x = torch.randint(0, 128, (2, 32))
    assert (plain.eval()(x) - adapted.eval()(x)).abs().max() < 1e-5


def test_targets_that_name_no_layer_are_one_line(tmp_path: Path) -> None:
    proc = dtlab("train", *LORA, "train.lora.targets=[qproj]", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    assert ("train.lora.targets=['qproj'] names no linear layer of this model" in proc.stderr
            and "fix: choose among down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj,"
            " v_proj" in proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_without_peft_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import fails as if not installed
    proc = dtlab("train", *LORA, f"run.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "dtlab: error: train.lora needs the peft package; fix: pip install 'dtlab[lora]'")
