"""dtlab predict as a user runs it: the table, its JSON, profile files, and bad input refused."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import dtlab, needs
from test_bad_inputs import refused

from dtlab.predict.cluster import load_cluster


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A measured profile of the quick config, a poor comm fit and a cluster file using it."""
    ws = tmp_path_factory.mktemp("predict")
    proc = dtlab("predict", "--world-size", "2", "--cluster", "cpu_gloo", "--measure",
                 "--strategies", "ddp", "--save-profile", str(ws / "quick.json"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (ws / "out.json").write_text(proc.stdout)
    rows = [{"op": "all_reduce", "world_size": 2, "size_bytes": s, "time_us": t}
            for s, t in ((1024, 50.0), (4096, 900.0), (65536, 60.0))]  # not a line
    (ws / "noisy.json").write_text(json.dumps(rows))
    cluster = (Path(__file__).resolve().parents[1] / "configs/clusters/cpu_gloo.yaml").read_text()
    (ws / "noisy.yaml").write_text(cluster.replace("cpu_gloo_comm.json", str(ws / "noisy.json")))
    (ws / "not_a_profile.json").write_text('{"steps": 1}')
    whole = json.loads((ws / "quick.json").read_text())
    del whole["n_params"]
    (ws / "no_size.json").write_text(json.dumps(whole))
    return ws


def test_prediction_json_has_every_number_with_its_source(workspace: Path) -> None:
    """--measure --json: step time, throughput per device, MFU, the split and memory, with sources."""
    out = json.loads((workspace / "out.json").read_text())
    row = out["rows"][0]
    assert out["world_size"] == 2 and out["cluster"] == "cpu_gloo" and row["strategy"] == "ddp"
    assert row["step_s"] > 0 and row["traced_on"] == "cpu"
    assert row["samples_per_s"] == pytest.approx(64 / row["step_s"], rel=1e-9)
    assert row["samples_per_s_per_device"] == pytest.approx(row["samples_per_s"] / 2, rel=1e-9)
    assert 0 < row["mfu"] < 1 and row["peak_tflops"] > 0
    assert row["split"]["forward"] > 0 and row["split"]["backward"] > 0
    simulated = sum(row["split"].values()) + sum(row["exposed_comm"].values())
    assert simulated + row["overhead_s"] == pytest.approx(row["step_s"] - row["data_s"], rel=1e-6)
    # the batch's loading, the one part of a reported step a trace does not run (0.16 ms of the
    # quick CNN's 8 ms here; the loop's whole overhead, 0.6 ms, would count the stepper twice)
    assert 0 < row["data_s"] < 0.05 * row["step_s"]
    overhead = load_cluster("cpu_gloo").overhead_for(2)  # the shipped file's, measured
    assert overhead > 0 and row["overhead_s"] == pytest.approx(simulated * overhead, rel=1e-6)
    assert row["sources"]["overhead"] == [
        "measured on this machine, quiet, 2026-11-29 (2 ranks 04:31-04:37, 4 ranks 11:44-11:47)"]
    assert row["sources"]["compute"] and all(s.startswith("measured") for s in row["sources"]["compute"])
    assert row["memory"]["device_bytes"] > 0 and row["fits"] is True
    assert out["fastest"]["strategy"] == "ddp"


def test_profile_file_records_what_was_measured(workspace: Path) -> None:
    """--save-profile writes the device, dtype, threads, torch version, model and per-block times."""
    data = json.loads((workspace / "quick.json").read_text())
    assert data["dtlab_profile"] == 1 and data["dtype"] == "fp32" and data["device"] == "cpu"
    assert data["threads"] >= 1 and data["torch"] and data["model"] == "cnn"
    phases = {r["phase"] for r in data["table"]["ddp"]}
    assert {"forward", "backward", "optimizer"} <= phases
    assert data["steps"]["ddp"] == pytest.approx(sum(r["seconds"] for r in data["table"]["ddp"]))


def test_advise_ranks_the_strategies_that_fit_by_predicted_step_time() -> None:
    """advise --cluster: the dtlab strategies of the fitting layouts, fastest first, x slower."""
    proc = dtlab("advise", "--config", "configs/quick.yaml", "--gpus", "2", "--gpu-memory", "80",
                 "--cluster", "h100_sxm_8x", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranked = json.loads(proc.stdout)["by_step_time"]
    assert {r["strategy"] for r in ranked} == {"ddp", "fsdp", "hsdp", "zero1"}
    times = [r["step_s"] for r in ranked]
    assert times == sorted(times) and ranked[0]["slower"] == 1
    assert all(r["slower"] == pytest.approx(r["step_s"] / times[0], rel=1e-9) for r in ranked)


@pytest.mark.parametrize("slower,close", [(1.19, True), (1.21, False)])
def test_a_margin_under_1_2x_is_too_close_to_call(slower: float, close: bool) -> None:
    """The verdict names the fastest that fits and its margin over the next; under 1.2x (where
    dtlab's own check ordered pairs barely better than chance) it says so and what to do."""
    from dtlab.predict.cli import verdict
    from dtlab.predict.core import fastest

    rows = [{"strategy": "fsdp", "step_s": 1.0}, {"strategy": "ddp", "step_s": slower},
            {"strategy": "zero1", "step_s": 0.5, "fits": False}]
    best = fastest(rows)
    assert best == {"strategy": "fsdp", "step_s": 1.0, "runner_up": "ddp",
                    "speedup": slower, "close_call": close}
    line = verdict(best, rows)
    assert line.startswith(f"fastest that fits: fsdp, {slower:.2f}x the next (ddp)")
    assert ("too close to call" in line and "fix: run both (dtlab compare)" in line) == close


def test_the_table_keeps_three_digits_of_small_numbers() -> None:
    """A small model on a GPU cluster steps in a fraction of a millisecond: the table shows it
    to three significant digits, not as "0.0"; from 10 up, to 0.1."""
    from dtlab.predict.cli import ms

    assert [ms(s) for s in (0.0000724, 0.00524, 0.0123, 1.13514, 0.0, None)] == [
        "0.0724", "5.24", "12.3", "1135.1", "0", "-"]


JSON_COMMANDS = {  # each --json command, and a function it calls while it works
    "doctor": (("doctor", "--json", "--no-smoke"), "dtlab.doctor", "run_checks"),
    "estimate": (("estimate", "--json", "--world-size", "2", "--config", "configs/quick.yaml"),
                 "dtlab.estimate.cli", "build_setup"),
    "advise": (("advise", "--json", "--gpus", "2", "--gpu-memory", "80", "--config",
                "configs/quick.yaml", "--cluster", "h100_sxm_8x"), "dtlab.estimate.cli",
               "build_setup"),
    "predict": (("predict", "--json", "--world-size", "8", "--cluster", "h100_sxm_8x",
                 "--strategies", "ddp"), "dtlab.predict.cli", "predict_all"),
}


@pytest.mark.parametrize("command", list(JSON_COMMANDS))
def test_json_is_all_that_reaches_stdout(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--json's stdout is the JSON alone: what a library or a child process prints while the
    command works goes to stderr. The chatter is DeepSpeed's kind: a logging handler bound to
    the process's stdout before the command started, a print, and a child process's line."""
    import importlib
    import io
    import logging
    import subprocess
    import sys

    args, module, name = JSON_COMMANDS[command]
    owner = importlib.import_module(module)
    real = getattr(owner, name)
    logger = logging.getLogger("dtlab-test-chatty-library")
    handler = logging.StreamHandler(io.TextIOWrapper(io.FileIO(1, "w", closefd=False)))
    logger.addHandler(handler)

    def chatty(*a, **k):
        logger.warning("[WARNING] a library's log line")
        print("a library's print")
        subprocess.run([sys.executable, "-c", "print('a child process line')"], check=True)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, chatty)
    try:
        proc = dtlab(*args)
    finally:
        logger.removeHandler(handler)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # doctor: 1 where a check fails here
    json.loads(proc.stdout)  # the whole of it
    for line in ("a library's log line", "a library's print", "a child process line"):
        assert line in proc.stderr


@needs("deepspeed", "deepspeed")
def test_deepspeeds_import_lines_stay_off_json_stdout() -> None:
    """With DeepSpeed installed, the doctor's NVMe check imports it, and DeepSpeed logs its
    accelerator line to stdout on first import: in a process of its own, `dtlab doctor --json`
    still prints JSON alone, and the line reaches stderr."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "dtlab", "doctor", "--json", "--no-smoke"],
                          cwd=ROOT, text=True, capture_output=True, timeout=240,
                          env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    json.loads(proc.stdout)
    assert "real_accelerator.py" in proc.stderr  # DeepSpeed did speak, on stderr


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_is_predicted_from_the_roofline(stage: int) -> None:
    """deepspeed on a GPU cluster (a trace without values): a prediction, parsed from --json."""
    pytest.importorskip("deepspeed")
    proc = dtlab("predict", "--world-size", "16", "--gpus-per-node", "8", "--cluster",
                 "h100_sxm_8x", "--strategies", f"deepspeed:{stage},fsdp", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["strategy"]: r for r in json.loads(proc.stdout)["rows"]}
    assert rows[f"deepspeed:{stage}"]["step_s"] > 0
    assert rows[f"deepspeed:{stage}"]["sources"]["compute"] == rows["fsdp"]["sources"]["compute"]


def test_strategies_traced_side_by_side_predict_what_one_process_does() -> None:
    """Without --measure the strategies' traces run in forked processes (--jobs), the
    model-parallel ones started first: the rows are those of one process tracing them one after
    the other, number for number, in the order asked. (ddp on a config written for tp: its
    memory splits the batch as ddp does, not as the file's strategy would.)"""
    # 32 ranks: above estimate.measure.EVERY_RANK, the memory measures a few ranks, not each
    args = ["predict", "--config", "configs/tp_gpt.yaml", "--world-size", "32", "--gpus-per-node",
            "8", "--cluster", "h100_sxm_8x", "--strategies", "ddp,fsdp_tp@16x2", "--json",
            "model.n_layer=1"]
    serial, forked = dtlab(*args, "--jobs", "1"), dtlab(*args, "--jobs", "2")
    assert serial.returncode == 0 and forked.returncode == 0, forked.stderr[-2000:]
    assert json.loads(forked.stdout) == json.loads(serial.stdout)
    assert [r["strategy"] for r in json.loads(forked.stdout)["rows"]] == \
        ["ddp", "fsdp_tp@16x2"]
    # a strategy's own refusal, raised in its process: said once, as one process says it
    refused = dtlab(*args[:1], *args[3:9], "--strategies", "ddp,tp", "--jobs", "2")  # quick.yaml
    assert refused.returncode == 2 and refused.stderr.count("dtlab: error:") == 1
    assert "--strategies 'tp' on --world-size 32" in refused.stderr


CASES = [
    ("jobs with measure", "predict --world-size 2 --cluster cpu_gloo --measure --jobs 2", "--jobs"),
    ("advise by time without a config",
     "advise --n-params 7e9 --gpus 8 --gpu-memory 80 --cluster h100_sxm_8x", "--config"),
    ("unknown cluster", "predict --world-size 8 --cluster h99_pcie", "h99_pcie"),
    ("no cluster", "predict --world-size 8", "--cluster is required"),
    ("profile of another model",
     "predict --world-size 2 --cluster cpu_gloo --profile {ws}/quick.json model.name=gpt",
     "was measured for model cnn"),
    ("profile of another dtype",
     "predict --world-size 2 --cluster cpu_gloo --profile {ws}/quick.json train.precision=bf16",
     "dtype fp32"),
    ("not a profile", "predict --world-size 2 --cluster cpu_gloo --profile {ws}/not_a_profile.json",
     "is not a dtlab profile file"),
    ("a profile without its model's size",
     "predict --world-size 2 --cluster cpu_gloo --profile {ws}/no_size.json",
     "is not a dtlab profile file"),
    ("a world size the strategy cannot take",
     "predict --world-size 3 --cluster cpu_gloo --strategies ddp", "--world-size 3"),
    ("a mesh of another world size",
     "predict --world-size 8 --cluster h100_sxm_8x --strategies fsdp_tp@2x2 model.name=gpt",
     "fsdp_tp@2x2"),
    ("a poor comm fit", "predict --world-size 2 --cluster {ws}/noisy.yaml", "all_reduce"),
    ("save-profile without measure",
     "predict --world-size 2 --cluster cpu_gloo --save-profile {ws}/p.json", "--measure"),
    ("step time without a profile",
     "predict --world-size 2 --cluster cpu_gloo --step-time 0.5", "--profile"),
    ("validate on more ranks than the machine can time",
     "predict --validate --world-size 4096 --strategies ddp", "--world-size 4096 would run"),
    ("validate with a profile of another machine",
     "predict --validate --world-size 2 --profile {ws}/quick.json", "--profile does not apply"),
    ("save-profile over another file",
     "predict --world-size 2 --cluster cpu_gloo --measure --save-profile {ws}/noisy.yaml",
     "is not a dtlab profile"),
]


@pytest.mark.parametrize("case,command,message", CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line(workspace: Path, case: str, command: str, message: str) -> None:
    """Each bad input to predict: exit 2, one line naming it and the fix, nothing written."""
    error = refused(shlex.split(command.format(ws=workspace)), workspace)
    assert message in error, error


@pytest.mark.parametrize(("predicted_s", "timed"), [(0.001, 96), (0.017, 89), (0.1, 15), (2.0, 8)])
def test_a_validating_run_times_about_1_5_s_of_steps(predicted_s: float, timed: int) -> None:
    """--validate sizes each run from its prediction: 8-96 timed steps after a third of warm-up
    (truth.measure_run's), so that short, widely spread steps give a median that holds still."""
    from dtlab.predict.truth import warmup_of
    from dtlab.predict.validate import run_steps

    steps = run_steps(predicted_s)
    assert steps - warmup_of(steps) == timed


def test_advise_searches_layouts_and_traces_the_fastest_that_fit() -> None:
    """advise --cluster on 8 GPUs: data-parallel strategies and FLAVOUR@ppP.tpT layouts with
    their microbatch counts are searched; what dtlab refuses says why; the fastest that fit by
    the screen are traced by predict and ranked by its step time."""
    proc = dtlab("advise", "--config", "configs/fsdp_gpt.yaml", "--gpus", "8", "--gpu-memory", "80",
                 "--cluster", "h100_sxm_8x", "--trace-most", "1", "--json", "train.precision=bf16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    searched = {(r["layout"], r["microbatches"]): r for r in out["searched"]}
    assert {("fsdp", None), ("fsdp@tp2", None), ("fsdp@pp2.tp2", 2), ("single@pp2.tp4", 2),
            ("ddp@pp4", 4)} <= set(searched)
    refused = searched[("ddp@tp2", None)]["refused"]
    assert "which dtlab runs with fsdp or single only; fix: fsdp@tp2" in refused
    screened = [r for r in out["searched"] if r["screen"]]
    assert all(r["screen"]["step_s"] >= r["screen"]["compute_s"] > 0 for r in screened)
    pipelines = [r for r in screened if r["layout"] == "fsdp@pp2" and r["microbatches"]]
    assert all(r["screen"]["bubble_s"] == pytest.approx(r["screen"]["compute_s"] / r["microbatches"])
               for r in pipelines)  # (p - 1) / m of the compute, p = 2
    ranked = out["by_step_time"]
    assert len(ranked) == 1 and ranked[0]["slower"] == 1
    traced = [r for r in out["searched"] if r["predicted_step_s"]]
    assert len(traced) == 1 and out["why"].startswith(ranked[0]["strategy"])
    fastest = min((r for r in screened if r["screen"]["device_bytes"] <= 80e9),
                  key=lambda r: r["screen"]["step_s"])
    assert traced[0]["layout"] == fastest["layout"]  # the screen chose what to trace


def test_tokens_gives_the_days_gpu_hours_and_cost_to_train() -> None:
    """--tokens N: N / the row's tokens per second, in days, x the GPUs in GPU-hours, x the
    price of one; the wrong inputs are one line each."""
    proc = dtlab("predict", "--config", "configs/fsdp_gpt.yaml", "--world-size", "16",
                 "--cluster", "h100_sxm_8x", "--strategies", "fsdp", "--tokens", "2.5B",
                 "--gpu-hour-cost", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)["rows"]
    seconds = 2.5e9 / row["tokens_per_s"]
    assert row["to_train"] == pytest.approx({
        "tokens": 2.5e9, "days": seconds / 86400, "gpu_hours": seconds / 3600 * 16,
        "cost": seconds / 3600 * 16 * 2, "gpu_hour_cost": 2.0}, rel=1e-12)
    for args, said in [
            (["--tokens", "1X"], "--tokens '1X' is not a number of tokens; fix: e.g. --tokens 15T"),
            (["--gpu-hour-cost", "2"], "--gpu-hour-cost prices the GPU-hours to train --tokens N"),
            (["--config", "configs/quick.yaml", "--tokens", "1T"],
             "--tokens: ddp's model does not train on tokens")]:
        proc = dtlab("predict", "--world-size", "2", "--cluster", "h100_sxm_8x", *args)
        assert proc.returncode == 2 and proc.stderr.startswith(f"dtlab: error: {said}"), proc.stderr
