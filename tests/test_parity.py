"""Loss parity: the same function is trained whatever the strategy (CPU, gloo, fp32).

`single` on one process against ddp, fsdp (FSDP2), fsdp1 FULL_SHARD and SHARD_GRAD_OP on two ranks,
at the same seed, data order and global batch: per-step losses and final parameters agree within
1e-5 (relative). Also checks that FSDP's sharding is real in bytes per rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dtlab, fast_launches, max_rel_dev, step_losses, train
from safetensors.torch import save_file

from dtlab.cli.compare import loss_deviation, param_deviation, parse_spec
from dtlab.errors import ConfigError

STEPS = 24
STRATEGIES = ["single", "ddp", "fsdp", "fsdp1", "fsdp1:SHARD_GRAD_OP"]
TOL = 1e-5


def param_dev(a: Path, b: Path) -> float:
    return param_deviation(a / "model.safetensors", b / "model.safetensors")


def test_deviation_measures(tmp_path: Path) -> None:
    assert loss_deviation([1.0, 2.0], [1.0, 2.5]) == pytest.approx(0.2)
    assert loss_deviation([1.0], [1.0, 2.0]) == float("inf")  # a missing step is a failure
    save_file({"w": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.5])}, str(tmp_path / "a"))
    save_file({"w": torch.tensor([1.0, -4.2]), "b": torch.tensor([0.5])}, str(tmp_path / "b"))
    assert param_deviation(tmp_path / "a", tmp_path / "b") == pytest.approx(0.2 / 4.2)
    save_file({"w": torch.tensor([1.0, -4.0])}, str(tmp_path / "c"))
    assert param_deviation(tmp_path / "c", tmp_path / "b") == float("inf")  # a missing tensor
    assert parse_spec("fsdp1:HYBRID_SHARD") == [
        "strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=HYBRID_SHARD"]
    with pytest.raises(ConfigError, match=r"only fsdp1 takes a variant \(FULL_SHARD.*deepspeed its ZeRO stage.* pp a schedule"):
        parse_spec("ddp:FULL_SHARD")


@pytest.fixture(scope="module")
def parity(session_dir: Path) -> Path:
    out = session_dir / "parity"
    with fast_launches():
        proc = dtlab("compare", "--strategies", ",".join(STRATEGIES), "--nproc-per-node", "2",
                     "--verify", "--out", str(out), f"train.max_steps={STEPS}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"verify passed: {STEPS} steps vs single" in proc.stdout
    return out


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_losses_and_parameters_match_single(parity: Path, strategy: str) -> None:
    ref = step_losses(parity / "single")
    losses = step_losses(parity / strategy.replace(":", "-"))
    assert len(ref) == STEPS and ref[0] != ref[-1]  # it trained
    assert max_rel_dev(losses, ref) < TOL
    assert param_dev(parity / strategy.replace(":", "-"), parity / "single") < TOL


def test_compare_writes_its_table(parity: Path) -> None:
    rows = json.loads((parity / "compare.json").read_text())
    assert [r["strategy"] for r in rows] == STRATEGIES
    assert all(float(r["loss_dev"]) < TOL and float(r["param_dev"]) < TOL for r in rows)
    header = (parity / "compare.csv").read_text().splitlines()[0]
    assert header.startswith("strategy,ranks,samples_per_s,step_time_ms,tflops_per_rank,mfu_pct,"
                             "peak_mem_mib")


def test_sharding_is_real(parity: Path) -> None:
    def mem(name: str) -> dict[str, list[int]]:
        return json.loads((parity / name / "summary.json").read_text())["memory_per_rank"]

    summary = json.loads((parity / "ddp" / "summary.json").read_text())
    full = summary["n_params"] * 4  # fp32
    ddp = mem("ddp")
    assert ddp["param_bytes"] == [full, full] and ddp["grad_bytes"] == [full, full]
    assert ddp["optim_bytes"] == [full, full]  # SGD momentum: one buffer per parameter
    for name in ("fsdp", "fsdp1", "fsdp1-SHARD_GRAD_OP"):
        m = mem(name)
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            per_rank = m[key]
            assert sum(per_rank) >= full, (name, key, per_rank)  # every byte is held somewhere
            # Half of DDP's per rank, up to the padding that makes shards even.
            assert all(abs(b - full / 2) <= 0.02 * full for b in per_rank), (name, key, per_rank)


def test_gradient_accumulation_matches_single(parity: Path, session_dir: Path) -> None:
    ref = parity / "single"
    for strategy in ("ddp", "fsdp", "fsdp1"):
        run = session_dir / f"accum-{strategy}"
        summary = train(run, f"strategy.name={strategy}", "train.grad_accum_steps=2",
                        f"train.max_steps={STEPS}", "run.save_model=true", nproc=2)
        assert summary["micro_batch_size"] == 16 and summary["grad_accum_steps"] == 2
        assert max_rel_dev(step_losses(run), step_losses(ref)) < TOL, strategy
        assert param_dev(run, ref) < TOL, strategy


def test_deviation_is_measured_not_assumed(parity: Path, session_dir: Path) -> None:
    """A different data order must show up as a deviation far beyond the tolerance."""
    run = session_dir / "other-seed"
    train(run, "strategy.name=ddp", "seed=1", f"train.max_steps={STEPS}", "run.save_model=true",
          nproc=2)
    assert max_rel_dev(step_losses(run), step_losses(parity / "single")) > 100 * TOL
    assert torch.isfinite(torch.tensor(step_losses(run))).all()
