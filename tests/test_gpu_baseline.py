"""benchmarks/gpu_baseline.py's hand-written models are dtlab's models: the same parameter count
and, given dtlab's weights, the same outputs; its hand loop runs and starts at ln(vocab)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import ROOT

from dtlab.config import load_config
from dtlab.data import spec_for
from dtlab.models import build_model, count_params

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_baseline as gb  # noqa: E402


def configs(workload: str, *extra: str) -> object:
    return load_config(str(ROOT / gb.WORKLOADS[workload][0]),
                       [*gb.overrides(workload, False, 40, 10, "cpu"), *extra])


@pytest.mark.parametrize(("workload", "extra", "expected"), [
    ("gpt", (), 163_100_160),  # the benchmark's 12 x 768, vocabulary 50304, untied
    ("gpt", ("model.tie_weights=true", "model.bias=false"), 124_373_760),
    ("resnet", (), 11_173_962),  # CIFAR ResNet-18
    ("resnet", ("model.width=0.5",), 2_797_610),
    ("resnet", ("model.depth=34", "model.width=0.5"), 5_326_506),
])
def test_hand_models_have_dtlabs_parameter_count(workload: str, extra: tuple[str, ...],
                                                 expected: int) -> None:
    cfg = configs(workload, *extra)
    with torch.device("meta"):
        assert count_params(build_model(cfg.model, spec_for(cfg))) == expected
        assert gb.n_params(gb.hand_model(cfg)) == expected


def gpt_weights_for_hand(dtlab_state: dict[str, torch.Tensor], n_layer: int) -> dict:
    """dtlab's GPT state dict under the hand GPT's names: q, k, v fused into one matrix."""
    out = {k: dtlab_state[k] for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias",
                                       "lm_head.weight")}
    for i in range(n_layer):
        d, h = f"h.{i}.", f"blocks.{i}."
        out[h + "attn.qkv.weight"] = torch.cat([dtlab_state[d + f"attn.{n}_proj.weight"]
                                                for n in "qkv"])
        out[h + "attn.q_bias"] = dtlab_state[d + "attn.q_proj.bias"]
        out[h + "attn.v_bias"] = dtlab_state[d + "attn.v_proj.bias"]
        pairs = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.proj": "attn.out_proj", "fc": "mlp.fc",
                 "fc_proj": "mlp.proj"}
        for hand, dt in pairs.items():
            for p in ("weight", "bias"):
                out[f"{h}{hand}.{p}"] = dtlab_state[f"{d}{dt}.{p}"]
    return out


def test_hand_gpt_computes_dtlabs_function() -> None:
    cfg = load_config(str(ROOT / "configs/fsdp_gpt.yaml"), gb.overrides("gpt", True, 3, 2, "cpu"))
    torch.manual_seed(0)
    ours, hand = build_model(cfg.model, spec_for(cfg)), gb.hand_model(cfg)
    hand.load_state_dict(gpt_weights_for_hand(ours.state_dict(), cfg.model.n_layer))
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    torch.testing.assert_close(hand(idx), ours(idx), rtol=1e-5, atol=1e-5)


def test_hand_resnet_computes_dtlabs_function() -> None:
    cfg = configs("resnet", "model.width=0.25")
    torch.manual_seed(0)
    ours, hand = build_model(cfg.model, spec_for(cfg)), gb.hand_model(cfg)
    # The same layers in the same order: parameters and BatchNorm buffers pair up one to one.
    hand.load_state_dict(dict(zip(hand.state_dict(), ours.state_dict().values(), strict=True)))
    x = torch.randn(3, 3, 32, 32)
    for mode in (True, False):  # batch statistics, then running statistics
        ours.train(mode), hand.train(mode)
        torch.testing.assert_close(hand(x), ours(x), rtol=1e-4, atol=1e-5)


def test_hand_loop_runs_the_smoke_gpt(tmp_path) -> None:
    args = gb.argparse.Namespace(smoke=True, steps=3, warmup=2, device="cpu")
    result = gb.hand_run("gpt", False, args)
    assert len(result["step_times_s"]) == 5 and result["median_step_time_s"] > 0
    assert result["n_params"] == result["dtlab_n_params"] == 118_400
    # random tokens at GPT-2's init scale: near-uniform predictions, loss ~ ln(vocab) = 4.85
    assert abs(result["final_loss"] - math.log(128)) < 0.2
    assert result["flops_per_step"] > 0
    # CPU: peak RSS of the set-up, the warm-up and the timed steps (dtlab.instruments.metrics.restart_peak)
    assert all(result[f"{p}peak_bytes"] > 0 for p in ("setup_", "warmup_", ""))


def test_unknown_workload_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gb.main(["--workloads", "gpt,vit"]) == 2
    err = capsys.readouterr().err
    assert err == ("gpu_baseline: error: unknown workload or mode vit; fix: choose --workloads "
                   "from gpt,resnet and --modes from eager,compiled\n")


def test_resnet_memory_splits_the_hand_loops_step_by_category(tmp_path) -> None:
    """benchmarks/resnet_memory.py's hand side: the profiled step's peak holds every parameter
    and momentum buffer (SGD's state) of the ResNet-18, exactly."""
    import resnet_memory as rm

    args = rm.argparse.Namespace(batch=2, precision="fp32", channels_last=False, device="cpu",
                                 threads=1)
    result = rm.hand_side(args, tmp_path)
    by_category = result["memory_peak_by_category"]
    assert by_category["parameter"] == by_category["optimizer_state"] == 11_173_962 * 4
    assert by_category["activation"] > 0 and result["memory_peak_bytes"] == sum(by_category.values())
    assert all(result[f"{p}peak_rss_bytes"] > 0 for p in ("setup_", "warmup_", ""))
