"""Context parallelism: each sequence split into contiguous chunks over a group of ranks,
attention run as a ring (torch's ring, with the CPU kernel it lacks: strategies/ring_attention.py),
FSDP2 over data-parallel x context ranks, and tensor parallelism inside each context rank, for
dtlab's GPT on 4 gloo ranks against `single`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import max_rel_dev, step_losses
from test_model_parallel import GPT_TINY, TOL
from test_three_d import verified

from dtlab.cli.compare import param_deviation, run_label

SETTINGS = [*(o for o in GPT_TINY if not o.startswith("train.max_steps")), "train.max_steps=4",
            "train.optimizer=sgd", "train.weight_decay=0"]
LAYOUTS = ["fsdp@cp2", "single@tp2.cp2"]


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    return verified(session_dir / "context-parallel", LAYOUTS, 4, 4, *SETTINGS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_losses_and_parameters_match_single(runs: Path, layout: str) -> None:
    ref = step_losses(runs / "single")
    run = runs / run_label(layout)
    assert max_rel_dev(step_losses(run), ref) < TOL
    assert param_deviation(run / "model.safetensors", runs / "single" / "model.safetensors") < TOL


def test_context_parallel_runs_on_its_mesh(runs: Path) -> None:
    s = json.loads((runs / run_label("fsdp@cp2") / "summary.json").read_text())
    assert (s["layout"], s["world_size"]) == ("fsdp@cp2", 4)
    assert s["strategy_options"] == {"mesh": {"dp": 2, "cp": 2}, "attention": "ring", "dp": "fsdp"}
    s = json.loads((runs / run_label("single@tp2.cp2") / "summary.json").read_text())
    assert s["strategy_options"]["mesh"] == {"dp": 1, "cp": 2, "tp": 2}
    assert s["val_acc"] == json.loads((runs / "single/summary.json").read_text())["val_acc"]
