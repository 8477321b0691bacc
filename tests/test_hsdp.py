"""HSDP on FSDP2 (`hsdp`): FSDP2 inside shard groups, replicated across them (CPU, gloo, fp32).

`single` against hsdp on a 2x2 mesh (4 ranks): per-step losses and final parameters within 1e-5,
with gradient accumulation (no gradient sync until the last micro batch); each rank holds half of
the parameters, and `dtlab estimate` gives the same bytes per rank; results label it `hsdp@2x2`; its traffic formula reduces to FSDP's and DDP's at the
two ends of the mesh; bad meshes are refused before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, dtlab, fast_launches, max_rel_dev, step_losses

from dtlab.cli.compare import param_deviation, parse_spec, spec_ranks
from dtlab.cli.main import main
from dtlab.config import check_world, load_config
from dtlab.config.strategies import registry
from dtlab.errors import ConfigError
from dtlab.results.collect import collect

STEPS = 12
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    out = session_dir / "hsdp"
    with fast_launches():
        proc = dtlab("compare", "--strategies", "single,hsdp@2x2", "--nproc-per-node", "4",
                     "--verify", "--out", str(out), f"train.max_steps={STEPS}",
                     "train.grad_accum_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"verify passed: {STEPS} steps vs single" in proc.stdout
    return out


def test_hsdp_trains_the_same_function_as_single(runs: Path) -> None:
    ref = step_losses(runs / "single")
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert max_rel_dev(step_losses(runs / "hsdp-2x2"), ref) < TOL
    assert param_deviation(runs / "hsdp-2x2" / "model.safetensors",
                           runs / "single" / "model.safetensors") < TOL


def test_each_rank_holds_its_shard_group_part(runs: Path) -> None:
    single = json.loads((runs / "single" / "summary.json").read_text())
    hsdp = json.loads((runs / "hsdp-2x2" / "summary.json").read_text())
    assert hsdp["world_size"] == 4
    assert hsdp["strategy_options"]["mesh"] == {"replicate": 2, "shard": 2}
    full = single["memory_per_rank"]["param_bytes"][0]
    per_rank = hsdp["memory_per_rank"]["param_bytes"]
    # a shard group of 2 splits every parameter on dim 0 (padded to even rows): half, plus padding
    assert len(per_rank) == 4 and len(set(per_rank)) == 1
    assert full / 2 <= per_rank[0] <= full / 2 * 1.02


def test_estimate_measures_the_same_bytes_per_rank(runs: Path, capsys: pytest.CaptureFixture) -> None:
    """`dtlab estimate` wraps the real model with the real hsdp strategy under the fake backend:
    its per-rank bytes equal what the 4-rank run measured, to the byte."""
    measured = json.loads((runs / "hsdp-2x2" / "summary.json").read_text())["memory_per_rank"]
    assert main(["estimate", "--world-size", "4", "--strategies", "hsdp@2x2", "--json",
                 f"train.max_steps={STEPS}", "train.grad_accum_steps=2"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["source"] == "measured (fake backend)"
    for kind in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert [r[kind] for r in row["per_rank"]] == measured[kind], kind


def test_results_label_it_by_its_mesh(runs: Path) -> None:
    rows = collect(runs)
    assert sorted(r["strategy"] for r in rows) == ["hsdp@2x2", "single"]


def test_traffic_reduces_to_fsdp_and_ddp_at_the_ends_of_the_mesh() -> None:
    hsdp, fsdp, ddp = registry.get("hsdp"), registry.get("fsdp"), registry.get("ddp")
    n, params = 8, 1000
    one_group = hsdp.comm_bytes({"mesh": {"replicate": 1, "shard": n}}, params, 4, 4, n)
    assert one_group == pytest.approx(fsdp.comm_bytes({}, params, 4, 4, n))
    no_sharding = hsdp.comm_bytes({"mesh": {"replicate": n, "shard": 1}}, params, 4, 4, n)
    assert no_sharding == pytest.approx(ddp.comm_bytes({}, params, 4, 4, n))
    # 2 x 4: FSDP over 4 ranks, then an all-reduce of a quarter of the gradients over 2
    both = hsdp.comm_bytes({"mesh": {"replicate": 2, "shard": 4}}, params, 4, 4, n)
    assert both == pytest.approx(3 / 4 * (2 * 4000 + 4000) + 2 * 1 / 2 * 1000)


def test_specs_and_bad_meshes() -> None:
    assert parse_spec("hsdp@2x4") == ["strategy.name=hsdp", "strategy.hsdp.shard_size=4"]
    assert spec_ranks("hsdp@2x4", 2) == 8 and spec_ranks("hsdp", 2) == 2
    cfg = load_config(None, ["strategy.name=hsdp", "strategy.hsdp.shard_size=3"])
    with pytest.raises(ConfigError, match="strategy.hsdp.shard_size=3 does not divide "
                                          "world_size=4 into shard groups; fix"):
        check_world(cfg, 4)
    assert check_world(load_config(None, ["strategy.name=hsdp"]), 4, 2) == 16
    proc = cli("compare", "--strategies", "hsdp:FULL_SHARD", "--out", "/nonexistent")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'hsdp:FULL_SHARD' is not valid" in proc.stderr
