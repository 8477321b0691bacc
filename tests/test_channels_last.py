"""model.channels_last: NHWC weights and inputs compute the same function as NCHW under the
data-parallel wrappers (2 ranks, fp32): the first loss within float rounding, the next ones
within the rounding that training amplifies; `auto` means on for CUDA only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import max_rel_dev, step_losses, train

from dtlab.config import load_config
from dtlab.models import memory_format

# A small ResNet (BatchNorm, strided and 1x1 convolutions), 8 steps. NHWC kernels sum in another
# order: the first loss (the same weights, before any update) differs by ~2e-7 relative; BatchNorm
# over 16 samples and ReLU then amplify it, to 6e-5-1.8e-4 by step 8 (measured). A wrong layout (a
# transposed image, weights read in the wrong order) is another function: O(1) from step 1.
RESNET = ("model.name=resnet", "model.width=0.125", "data.synthetic.train_samples=256",
          "data.synthetic.val_samples=64", "train.global_batch_size=32", "train.max_steps=8",
          "train.lr=0.002")
FIRST_TOL, TOL = 1e-6, 1e-3


# ddp: NHWC weights and inputs through a wrapper that keeps them; fsdp: NHWC inputs only
# (fully_shard takes contiguous weights). single and fsdp1 were measured the same way here.
@pytest.mark.parametrize(("strategy", "nproc"), [("ddp", 2), ("fsdp", 2)])
def test_channels_last_keeps_the_losses(tmp_path: Path, strategy: str, nproc: int) -> None:
    for layout in ("false", "true"):
        summary = train(tmp_path / layout, *RESNET, f"strategy.name={strategy}",
                        f"model.channels_last={layout}", nproc=nproc)
        assert summary["channels_last"] is (layout == "true")
    ref, nhwc = step_losses(tmp_path / "false"), step_losses(tmp_path / "true")
    assert len(ref) == 8 and ref[-1] != ref[0]  # it trained
    assert max_rel_dev(nhwc[:1], ref[:1]) < FIRST_TOL
    assert max_rel_dev(nhwc, ref) < TOL


def test_auto_is_on_for_cuda_and_the_input_is_converted() -> None:
    cfg = load_config(None, ["model.name=resnet", "model.width=0.125"]).model
    assert memory_format.wanted(cfg, torch.device("cuda"))
    assert not memory_format.wanted(cfg, torch.device("cpu"))
    from dtlab.data import DataSpec
    from dtlab.models import build_model

    model = build_model(cfg, DataSpec("image", 3, 32, 10))
    assert memory_format.apply(model, cfg.model_copy(update={"channels_last": True}),
                               torch.device("cpu"))
    seen = []
    model.stem[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(torch.randn(2, 3, 32, 32))
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
