"""run.deterministic, run.tf32, run.cudnn_benchmark (dtlab/levers/numerics.py): what each sets, that a
deterministic run keeps the losses (CPU kernels are deterministic already: the same bits), and
that `compare --verify` asks for it on CUDA only."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, step_losses, train

from dtlab.cli.compare import verify_numerics
from dtlab.config import load_config
from dtlab.levers import numerics

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def run_cfg(*overrides: str):  # noqa: ANN201 - the RunConfig section
    return load_config(None, list(overrides)).run


@pytest.fixture
def restore_numerics():  # noqa: ANN201
    """apply() sets process-wide state: put torch's back after the test."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.flash_sdp_enabled(),
             torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(saved[0])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = saved[1:5]
    torch.backends.cuda.enable_flash_sdp(saved[5])
    torch.backends.cuda.enable_mem_efficient_sdp(saved[6])
    torch.backends.cuda.enable_cudnn_sdp(saved[7])
    if saved[8] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[8]


def test_settings_resolve_autotuning_per_device() -> None:
    assert numerics.settings(run_cfg(), CUDA) == {"deterministic": False, "tf32": False,
                                                  "cudnn_benchmark": True}
    assert numerics.settings(run_cfg(), CPU)["cudnn_benchmark"] is False
    assert numerics.settings(run_cfg("run.deterministic=true"), CUDA)["cudnn_benchmark"] is False
    assert numerics.settings(run_cfg("run.cudnn_benchmark=false"), CUDA)["cudnn_benchmark"] is False
    assert numerics.settings(run_cfg("run.tf32=true"), CUDA)["tf32"] is True


def test_deterministic_sets_every_switch(restore_numerics: None) -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    numerics.apply(run_cfg("run.deterministic=true", "run.tf32=true"), CUDA)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not (torch.backends.cuda.flash_sdp_enabled()
                or torch.backends.cuda.mem_efficient_sdp_enabled()
                or torch.backends.cuda.cudnn_sdp_enabled())
    assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_deterministic_gpt_keeps_the_losses_to_the_bit(tmp_path: Path) -> None:
    tiny = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "data.synthetic.train_samples=256", "data.synthetic.val_samples=32",
            "train.max_steps=6", "strategy.name=fsdp", "model.dropout=0.1"]
    plain = train(tmp_path / "plain", *tiny, config=str(CONFIGS / "fsdp_gpt.yaml"), nproc=2)
    det = train(tmp_path / "det", *tiny, "run.deterministic=true",
                config=str(CONFIGS / "fsdp_gpt.yaml"), nproc=2)
    assert (plain["deterministic"], det["deterministic"], det["cudnn_benchmark"]) == (
        False, True, False)
    assert step_losses(tmp_path / "det") == step_losses(tmp_path / "plain")


def test_compare_verify_asks_for_it_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(verify=True, config=None, overrides=[])
    assert verify_numerics(args) == []  # CPU: nothing to ask for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert verify_numerics(args) == ["run.deterministic=true"]
    assert verify_numerics(argparse.Namespace(verify=False, config=None, overrides=[])) == []
    cpu = argparse.Namespace(verify=True, config=None, overrides=["run.device=cpu"])
    assert verify_numerics(cpu) == []
