"""`train.optimizer_impl`: for_loop, foreach and fused run the same update; auto picks fused
where the parameters' device has fused kernels (this CPU does, for SGD and AdamW)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ranks
import torch
from conftest import CONFIGS, max_rel_dev, step_losses, train

from dtlab.errors import ConfigError
from dtlab.levers.optim import resolve_impl

TINY_GPT = ("model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "data.synthetic.train_samples=512", "data.synthetic.val_samples=32",
            "train.max_steps=8", "train.warmup_steps=2", "train.checkpoint_every=0")
GPT = str(CONFIGS / "fsdp_gpt.yaml")
# foreach runs for_loop's arithmetic kernel by kernel (equal to the bit here); fused AdamW
# rounds differently inside its one kernel: 1e-7 relative measured over 8 steps.
TOL = 1e-6


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_implementation_gives_the_for_loop_losses(tmp_path: Path, optimizer: str) -> None:
    runs = {}
    for impl in ("for_loop", "foreach", "fused", "auto"):
        summary = train(tmp_path / impl, *TINY_GPT, "strategy.name=single",
                        f"train.optimizer={optimizer}", f"train.optimizer_impl={impl}", config=GPT)
        assert summary["optimizer_impl"] == ("fused" if impl == "auto" else impl)
        runs[impl] = step_losses(tmp_path / impl)
    for impl in ("foreach", "fused", "auto"):
        assert max_rel_dev(runs[impl], runs["for_loop"]) < TOL, impl
    assert runs["foreach"] == runs["for_loop"]  # the same kernels, one after the other


@pytest.mark.parametrize(("strategy", "optimizer", "auto"), [
    ("fsdp", "adamw", "fused"),   # DTensor shards AdamW's fused op
    ("fsdp", "sgd", "foreach"),   # ... not SGD's (torch 2.13): auto falls back
    ("zero1", "adamw", "fused"),  # a plain tensor partition
])
def test_over_shards_auto_gives_the_for_loop_losses(tmp_path: Path, strategy: str, optimizer: str,
                                                    auto: str) -> None:
    picked, loop = (train(tmp_path / impl, *TINY_GPT, f"strategy.name={strategy}",
                          f"train.optimizer={optimizer}", f"train.optimizer_impl={impl}",
                          config=GPT, nproc=2)
                    for impl in ("auto", "for_loop"))
    assert (picked["optimizer_impl"], loop["optimizer_impl"]) == (auto, "for_loop")
    assert max_rel_dev(step_losses(tmp_path / "auto"), step_losses(tmp_path / "for_loop")) < TOL


def test_fused_is_refused_where_the_parameters_cannot_take_it(tmp_path: Path) -> None:
    ints = [torch.zeros(3, dtype=torch.int64)]
    assert resolve_impl("auto", "adamw", ints) == "foreach"
    with pytest.raises(ConfigError, match=r"train.optimizer_impl=fused needs floating-point "
                                          r"parameters .* these are cpu int64; fix: set "
                                          r"train.optimizer_impl=auto or foreach"):
        resolve_impl("fused", "adamw", ints)
    proc = ranks.train(2, "--config", GPT, *TINY_GPT, "strategy.name=fsdp", "train.optimizer=sgd",
                       "train.optimizer_impl=fused", f"run.dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("train.optimizer_impl=fused needs a fused sgd for DTensor "
                             "parameters (FSDP2, TP)") == 1, proc.stderr
