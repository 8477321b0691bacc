"""FLOPs per step from torch's FlopCounterMode (meta device), checked against the analytic counts;
MFU with its peak's source, never from a guessed peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, train
from torch import nn

from dtlab.cli.compare import row_for
from dtlab.config import load_config
from dtlab.data import spec_for
from dtlab.instruments import flops
from dtlab.models import build_model
from dtlab.results.collect import row_from_run


def test_gpt_flops_are_6n_plus_12ldt_per_token() -> None:
    """N: the weights of the matrix multiplications (embedding lookups excluded), as torchtitan
    and nanoGPT count; 12 L d T: attention's scores and weighted sum (forward + backward)."""
    cfg = load_config(str(CONFIGS / "fsdp_gpt.yaml"), ["model.n_layer=6", "model.n_embd=192",
                                                      "model.n_head=6", "model.block_size=128"])
    spec = spec_for(cfg)
    model = build_model(cfg.model, spec)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    m = cfg.model
    tokens = 8 * m.block_size
    counted, hardware = flops.count(cfg, spec, 8)
    assert counted == hardware  # nothing recomputed
    assert counted == pytest.approx((6 * n + 12 * m.n_layer * m.n_embd * m.block_size) * tokens,
                                    rel=0.02)


def test_cnn_convolutions_match_their_analytic_count() -> None:
    cfg = load_config(None, [])
    spec = spec_for(cfg)
    b, s, widths = 16, spec.image_size, [spec.in_channels, *cfg.model.channels]
    expected = 0
    for i, (c_in, c_out) in enumerate(zip(widths, widths[1:], strict=False)):
        fwd = 2 * b * c_out * s * s * c_in * 9
        expected += fwd + fwd + (fwd if i else 0)  # forward, weight grad, input grad (not the data's)
        s //= 2
    with torch.device("meta"):
        model = build_model(cfg.model, spec)
        x, y = torch.randn(b, spec.in_channels, s * 4, s * 4), torch.randint(0, 10, (b,))
    with flops.FlopCounterMode(display=False) as counter:
        flops.loss_fn(model(x), y).backward()
    convs = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                if "convolution" in str(op))
    assert convs == expected


def test_checkpointing_adds_hardware_flops_not_model_flops() -> None:
    cfg = load_config(str(CONFIGS / "fsdp_gpt.yaml"), ["train.activation_checkpointing=full"])
    model_flops, hardware = flops.count(cfg, spec_for(cfg), 4)
    # one more forward of every block: forward is a third of forward + backward
    assert model_flops < hardware < model_flops * 4 / 3


def test_peaks_come_from_the_datasheet_the_override_or_nowhere() -> None:
    cuda = torch.device("cuda")
    assert flops.peak(cuda, "NVIDIA H100 80GB HBM3", "bf16", 1, None)[0] == 989.4
    assert flops.peak(cuda, "NVIDIA H100 PCIe", "bf16", 1, None)[0] == 756.0
    assert flops.peak(cuda, "NVIDIA A100-SXM4-80GB", "fp32", 1, None)[0] == 19.5
    assert flops.peak(cuda, "Some Future GPU", "bf16", 1, 123.0) == (123.0, "run.peak_tflops")
    top, note = flops.peak(cuda, "Some Future GPU", "bf16", 1, None)
    assert top is None and note == ("unknown device 'Some Future GPU': MFU not reported; "
                                    "set run.peak_tflops")


def test_a_run_reports_tflops_and_mfu_against_the_measured_cpu_matmul(tmp_path: Path) -> None:
    summary = train(tmp_path, "train.max_steps=5", "model.n_layer=2", "train.checkpoint_every=0",
                    "data.synthetic.val_samples=32", config=str(CONFIGS / "fsdp_gpt.yaml"))
    steps = summary["median_step_time_s"]
    assert summary["tflops_per_rank"] == pytest.approx(summary["flops_per_step"] / steps / 1e12)
    if summary["mfu"] is None:  # a loaded machine or an MFU above 100%: withheld, said why
        assert summary["mfu_note"].startswith("withheld: ")
        assert summary["timing"]["unreliable"] or "% of the peak of" in summary["mfu_note"]
    else:
        assert summary["mfu"] == pytest.approx(summary["tflops_per_rank"] / summary["peak_tflops"])
        assert 0 < summary["mfu"] <= 1  # a matmul before the run vs a whole step: same order
        assert summary["mfu_note"].startswith("float32 matmul measured on this CPU before the "
                                              "first step")
    row = row_for("single", summary)  # compare's table and results.csv carry them
    mfu_pct = None if summary["mfu"] is None else round(100 * summary["mfu"], 1)
    assert (row["tflops_per_rank"], row["mfu_pct"]) == (round(summary["tflops_per_rank"], 4),
                                                       mfu_pct)
    assert row_from_run(tmp_path, tmp_path.parent)["mfu"] == summary["mfu"]
