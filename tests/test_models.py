"""Models: shapes, any batch size, clear errors on wrong input, sharding units."""

from __future__ import annotations

import pytest
import torch

from dtlab.config import load_config
from dtlab.data import DataSpec
from dtlab.models import GPT, ResNet, SimpleCNN, build_model, count_params, has_batchnorm


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_cnn_accepts_any_batch_size(batch: int) -> None:
    model = SimpleCNN(3, 32, 10, channels=[8, 16, 32], hidden=20)
    assert model(torch.randn(batch, 3, 32, 32)).shape == (batch, 10)
    assert len(model.blocks()) == 4  # three conv stages + head


def test_cnn_wrong_input_shape_is_explained() -> None:
    model = SimpleCNN(1, 28, 10, channels=[4])
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, 1, 28, 28\), got \(2, 3, 28, 28\)"):
        model(torch.randn(2, 3, 28, 28))
    with pytest.raises(ValueError, match="halves 8px images to nothing"):
        SimpleCNN(3, 8, 10, channels=[4, 4, 4, 4])


def test_cnn_options() -> None:
    relu = SimpleCNN(channels=[4], activation="relu", pool="max", batch_norm=True)
    names = [type(m).__name__ for m in relu.stages[0]]
    assert names == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"] and has_batchnorm(relu)
    smooth = SimpleCNN(channels=[4])
    assert [type(m).__name__ for m in smooth.stages[0]] == ["Conv2d", "GELU", "AvgPool2d"]


def test_resnet_sizes() -> None:
    r18 = ResNet(18)
    assert count_params(r18) == 11_173_962  # the standard CIFAR ResNet-18
    assert len(r18.blocks()) == 8 and len(ResNet(34, width=0.25).blocks()) == 16
    assert ResNet(18, width=0.25)(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="expects input of shape"):
        r18(torch.randn(2, 1, 32, 32))


def test_gpt_shapes_and_errors() -> None:
    gpt = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
    idx = torch.randint(0, 50, (3, 16))
    assert gpt(idx).shape == (3, 16, 50) and len(gpt.blocks()) == 2
    with pytest.raises(ValueError, match=r"seq<=16"):
        gpt(torch.randint(0, 50, (3, 17)))
    with pytest.raises(ValueError, match="int64"):
        gpt(torch.randn(3, 16))
    tied = GPT(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50, tie_weights=True)
    assert tied.lm_head.weight is tied.wte.weight
    assert count_params(tied) == count_params(GPT(1, 2, 32, 16, 50)) - 50 * 32


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    gpt = GPT(n_layer=2, n_head=2, n_embd=32, block_size=8, vocab_size=20).eval()
    a = torch.randint(0, 20, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 20
    assert torch.allclose(gpt(a)[0, :-1], gpt(b)[0, :-1])  # the future does not leak


def test_build_model_from_config() -> None:
    cfg = load_config(None, ["model.channels=[4, 8]", "model.hidden=16"])
    model = build_model(cfg.model, DataSpec("image", 1, 28, 10))
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)
