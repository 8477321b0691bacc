"""dtlab sweep: specs, hashing, the local launcher, re-runs, failures and timeouts."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab

from dtlab.cli.main import main
from dtlab.errors import ConfigError
from dtlab.sweeps.spec import expand, load_spec


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace("BASE", str(CONFIGS / "quick.yaml")))
    return path


def test_expansion_hashes_configs_and_explains_invalid_combinations(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, """
base: BASE
overrides: {train.max_steps: 5}
matrix:
  strategy.name: [single, ddp]
  nproc_per_node: [1, 2]
  batch_per_rank: [16]
exclude: [{strategy.name: ddp, nproc_per_node: 1}]
"""))
    plans = expand(spec, tmp_path / "out", "local")
    assert [p.label for p in plans] == [
        "strategy.name=single nproc_per_node=1 batch_per_rank=16",
        "strategy.name=single nproc_per_node=2 batch_per_rank=16",
        "strategy.name=ddp nproc_per_node=2 batch_per_rank=16",
    ]
    single1, single2, ddp2 = plans
    assert "strategy.name=single runs one process" in single2.invalid
    assert single1.config.train.global_batch_size == 16 and ddp2.config.train.global_batch_size == 32
    assert ddp2.run_dir == tmp_path / "out" / "runs" / ddp2.key and len(ddp2.key) == 12
    again = expand(spec, tmp_path / "elsewhere", "local")
    assert [p.key for p in again] == [p.key for p in plans]  # the key ignores where runs live
    assert len({single1.key, ddp2.key}) == 2


@pytest.mark.parametrize(("text", "message"), [
    ("base: BASE\nmatrix: {train.lrr: [0.1]}", "unknown matrix key 'train.lrr'"),
    ("base: BASE\nmatrics: {}", "unknown config key 'matrics'"),
    ("base: missing.yaml", "config file 'missing.yaml' not found"),
    ("base: BASE\noverrides: {train.lr: -1}", "train.lr: Input should be greater than 0"),
    ("base: BASE\nmatrix: {nproc_per_node: []}", "matrix key 'nproc_per_node' has no values"),
    ("base: BASE\nmatrix: {strategy.name: [single], nproc_per_node: [2]}",
     "no combination of the matrix can run"),
    ("base: BASE\nmatrix: {nnodes: [2]}", "nnodes > 1 needs the slurm launcher"),
])
def test_bad_specs_exit_2_with_one_line(tmp_path: Path, capsys, text: str, message: str) -> None:
    assert main(["sweep", str(write_spec(tmp_path, text)), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o" / "runs").exists()


def test_dry_run_launches_nothing(tmp_path: Path, capsys) -> None:
    spec = write_spec(tmp_path, "base: BASE\nmatrix: {strategy.name: [ddp, fsdp], nproc_per_node: [2]}")
    assert main(["sweep", str(spec), "--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert out.count("would run:") == 2 and "--nproc-per-node 2 --config" in out
    assert not (tmp_path / "o").exists()
    assert main(["sweep", str(spec), "--dry-run", "--launcher", "slurm", "--out", str(tmp_path / "o")]) == 0
    assert "sbatch" in capsys.readouterr().out


def test_local_sweep_writes_results_plots_and_report(local_sweep) -> None:
    out, proc = local_sweep
    assert "4 of 4 runs done, 0 failed" in proc.stdout
    assert "[done 4 | failed 0 | running 0 | left 0]" in proc.stdout
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert sorted((r["series"], r["world_size"], r["status"]) for r in rows) == [
        ("ddp", "1", "done"), ("ddp", "2", "done"), ("fsdp", "1", "done"), ("fsdp", "2", "done")]
    assert all(float(r["samples_per_s"]) > 0 and float(r["epoch_time_s"]) > 0 for r in rows)
    figures = {f["name"] for f in json.loads((out / "plots" / "index.json").read_text())}
    assert {"epoch_time", "throughput", "scaling_efficiency", "val_loss", "val_acc",
            "peak_memory", "state_bytes"} <= figures
    assert (out / "report.html").stat().st_size > 10_000


def test_rerunning_a_finished_sweep_launches_nothing(local_sweep) -> None:
    out, _ = local_sweep
    spec = out.parent / "sweep.yaml"
    before = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*")}
    proc = dtlab("sweep", str(spec), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "4 already done, 0 to run" in proc.stdout and "running" not in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*")} == before


def test_crashed_and_timed_out_runs_are_recorded(tmp_path: Path) -> None:
    # The crash: 1 rank, which fails within a second of its imports (2 ranks on one core take
    # about as long to start as the 10 s the other run is allowed).
    spec = write_spec(tmp_path, """
base: BASE
overrides: {data.dir: /nonexistent, strategy.name: ddp}
matrix:
  data.name: [synthetic, mnist]
  train.max_steps: [100000, 4]
  nproc_per_node: [2, 1]
exclude: [{data.name: mnist, train.max_steps: 100000}, {data.name: synthetic, train.max_steps: 4},
          {data.name: synthetic, nproc_per_node: 1}, {data.name: mnist, nproc_per_node: 2}]
timeout_s: 10
""")
    proc = dtlab("sweep", str(spec), "--out", str(tmp_path / "o"), real_launches=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 of 2 runs done, 2 failed" in proc.stdout
    records = {r["label"]: r for r in (json.loads(p.read_text())
                                       for p in (tmp_path / "o").glob("runs/*/run.json"))}
    timed_out = records["data.name=synthetic train.max_steps=100000 nproc_per_node=2"]
    crashed = records["data.name=mnist train.max_steps=4 nproc_per_node=1"]
    assert timed_out["status"] == "timeout" and "exceeded the 10 s timeout" in timed_out["reason"]
    assert crashed["status"] == "failed" and crashed["returncode"] == 2
    assert "MNIST not found" in crashed["reason"]
    rows = list(csv.DictReader((tmp_path / "o" / "results.csv").read_text().splitlines()))
    assert sorted(r["status"] for r in rows) == ["failed", "timeout"]
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # the stopped run's launcher and workers are gone


def test_spec_base_relative_to_the_spec(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.yaml").write_text((CONFIGS / "quick.yaml").read_text())
    (tmp_path / "s.yaml").write_text("base: configs/mine.yaml\nmatrix: {seed: [1, 2]}\n")
    plans = expand(load_spec(tmp_path / "s.yaml"), tmp_path / "o", "local")
    assert [p.config.seed for p in plans] == [1, 2]
    with pytest.raises(ConfigError):
        load_spec(tmp_path / "absent.yaml")


@pytest.mark.parametrize(("name", "launcher", "runs"), [
    ("strategies_ranks.yaml", "local", 9), ("slurm_gpus.yaml", "slurm", 6)])
def test_shipped_specs_expand(tmp_path: Path, name: str, launcher: str, runs: int) -> None:
    plans = expand(load_spec(CONFIGS / "sweeps" / name), tmp_path, launcher)
    assert len(plans) == runs and not [p.invalid for p in plans if p.invalid]


def test_a_run_done_without_a_timed_step_is_reported_without_a_rate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that ends done with no step timed (summary samples_per_s null: a requeued job that
    resumed at its last step) is one progress line without a rate, not a traceback."""
    from dtlab.sweeps import Progress
    from dtlab.sweeps.spec import PlannedRun

    run = PlannedRun("nproc_per_node=2", {}, 2, 1, "srun", run_dir=tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"samples_per_s": None}))
    progress = Progress(total=1, done=0)
    progress.finish(run, "done", "", 0, 3.21)
    assert capsys.readouterr().out.strip() == (
        "[done 1 | failed 0 | running 0 | left 0] nproc_per_node=2: done in 3.2 s, no step timed")
    (tmp_path / "summary.json").write_text(json.dumps({"samples_per_s": 123.45}))
    progress.finish(run, "done", "", 0, 1.0)
    assert capsys.readouterr().out.strip().endswith("done in 1.0 s, 123.5 samples/s")
