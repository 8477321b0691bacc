"""Findings of an outside audit of 202 cases (2026-12-02): what lost or mixed a user's data is
refused in one line, before anything is written, with the user's files left byte for byte:
a run inside another run's checkpoints or a sweep's folders; a user's run.json in a run
directory; a second compare or sweep on an --out in use; a compare that would leave an earlier
compare's runs beside its table; an earlier table kept beside new runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab, fast_launches
from test_bad_inputs import refused, snapshot

QUICK = ["train.max_steps=2", "run.progress=false", "run.save_model=false"]


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize(("inside", "what", "above"), [
    ("A/checkpoints", "the run directory", "A"),
    ("A/checkpoints/step_000002", "the run directory", "A"),
    ("A/checkpoints/step_000002/sub", "the checkpoint", "A/checkpoints/step_000002"),
    ("A/notes", "the run directory", "A")])
def test_a_run_inside_another_runs_directory_is_refused(tmp_path: Path, inside: str, what: str,
                                                        above: str) -> None:
    """Its files would be pruned with the checkpoints, or collected as the outer run's."""
    ok(dtlab("train", *QUICK, "train.checkpoint_every=1", "run.dir=A", cwd=tmp_path))
    line = refused(["train", *QUICK, f"run.dir={inside}"], tmp_path)
    assert line.startswith(f"dtlab: error: run.dir '{inside}' is inside {what} '{tmp_path / above}'")
    assert line.endswith("; fix: a run.dir outside it")


def test_a_run_inside_a_sweeps_folders_is_refused_its_own_runs_are_not(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(f"base: {CONFIGS / 'quick.yaml'}\n"
                                     "overrides: {train.max_steps: 2}\nmatrix: {seed: [1]}\n")
    with fast_launches():
        ok(dtlab("sweep", "s.yaml", "--out", "S", cwd=tmp_path))
    (run,) = (tmp_path / "S/runs").iterdir()
    for inside in ("S/runs", f"S/runs/{run.name}/sub"):
        line = refused(["train", *QUICK, f"run.dir={inside}"], tmp_path)
        assert f"is inside the output of dtlab sweep '{tmp_path / 'S'}'" in line or \
            f"is inside the run directory '{run}'" in line, line
    # the sweep's own run started again by hand from its config.yaml would replace it behind the
    # sweep's results: only the sweep runs it (it continues it when run again)
    line = refused(["train", "--config", f"S/runs/{run.name}/config.yaml"], tmp_path)
    assert line == (f"dtlab: error: run.dir 'S/runs/{run.name}' is a run of dtlab "
                    f"sweep '{tmp_path / 'S'}', whose results describe it; fix: run that sweep "
                    "again to continue it, or a run.dir outside it"), line


def test_a_users_run_json_in_a_run_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r/run.json").write_text("my lab notebook: lr 0.05 looked best\n")
    line = refused(["train", *QUICK, "run.dir=r"], tmp_path)
    assert line == ("dtlab: error: run.dir 'r' holds run.json, which no dtlab run recorded "
                    "writing there and a run would replace; fix: move it away, run.overwrite=true "
                    "to delete it, or choose another run.dir")


def started(cmd: list[str], cwd: Path, ready: Path) -> subprocess.Popen[str]:
    """`dtlab CMD` as its own process, once `ready` exists (its first run is training)."""
    proc = subprocess.Popen([sys.executable, "-m", "dtlab", *cmd], cwd=cwd, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.2)
    return proc


def stopped(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C to the first command: it stops with its one line, no traceback."""
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err


def test_a_second_compare_on_an_out_in_use_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    args = ["compare", "--config", str(CONFIGS / "quick.yaml"), "--strategies", "single",
            "--out", "C"]
    first = started([*args, "train.max_steps=100000"], tmp_path, tmp_path / "C/single/metrics.jsonl")
    try:
        before = snapshot(tmp_path / "C")
        proc = dtlab(*args, "train.max_steps=2", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith(
            "dtlab: error: --out 'C' is in use by another dtlab compare (pid "), proc.stderr
        after = snapshot(tmp_path / "C")
        assert set(after) >= set(before) and "single/metrics.jsonl" in after  # still training
    finally:
        stopped(first)


def test_a_second_sweep_on_an_out_in_use_is_refused_and_touches_no_run(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(f"base: {CONFIGS / 'quick.yaml'}\noverrides: "
                                     "{train.max_steps: 100000}\nmatrix: {train.lr: [0.05]}\n")
    first = started(["sweep", "t.yaml", "--out", "ST"], tmp_path, tmp_path / "ST/runs")
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "ST/runs").glob("*/metrics.jsonl")):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        (log,) = (tmp_path / "ST/runs").glob("*/train.log")
        size = log.stat().st_size
        proc = dtlab("sweep", "t.yaml", "--out", "ST", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith(
            "dtlab: error: --out 'ST' is in use by another dtlab sweep (pid "), proc.stderr
        assert log.stat().st_size >= size and not log.read_bytes().startswith(b"dtlab: error")
    finally:
        stopped(first)


def test_a_compare_that_leaves_out_an_earlier_compares_runs_is_refused(tmp_path: Path) -> None:
    args = ["compare", "--nproc-per-node", "2", "--out", "C", "train.max_steps=2",
            "run.timing_warmup_steps=1"]
    with fast_launches():
        ok(dtlab(*args, "--strategies", "single,ddp", cwd=tmp_path))
        line = refused([*args, "--strategies", "single,fsdp"], tmp_path)
        assert line == ("dtlab: error: --out 'C' holds ddp from an earlier compare, which this one "
                        "does not run: its table would leave it out and collect and report would "
                        "mix it in; fix: add it to --strategies, --out a new directory, or move it "
                        "away")
        # a compare whose runs all fail leaves no table of the earlier runs beside them
        proc = dtlab(*args, "--strategies", "single,ddp", "run.fault.kind=exit",
                     "run.fault.step=1", cwd=tmp_path)
    assert proc.returncode == 1
    assert not (tmp_path / "C/compare.csv").exists() and not (tmp_path / "C/compare.json").exists()




MULTI = "series,strategy,world_size,status,samples_per_s\nddp,ddp,1,done,900.0\nddp,ddp,2,done,1800.0\n"
SINGLE = "series,strategy,world_size,status,samples_per_s\nddp,ddp,1,done,900.0\n"


def test_plot_again_leaves_no_figure_of_the_earlier_data(tmp_path: Path) -> None:
    (tmp_path / "multi.csv").write_text(MULTI)
    (tmp_path / "single.csv").write_text(SINGLE)
    ok(dtlab("plot", "multi.csv", "-o", "figs", cwd=tmp_path))
    assert (tmp_path / "figs/scaling_efficiency.png").is_file()  # two world sizes: a scaling
    ok(dtlab("plot", "single.csv", "-o", "figs", cwd=tmp_path))
    index = json.loads((tmp_path / "figs/index.json").read_text())
    drawn = {f["name"] for f in index}
    on_disk = {p.stem for p in (tmp_path / "figs").glob("*.png")}
    assert on_disk == drawn and "scaling_efficiency" not in drawn


def test_overwrite_removes_the_earlier_runs_report(tmp_path: Path) -> None:
    ok(dtlab("train", *QUICK, "run.dir=r1", cwd=tmp_path))
    ok(dtlab("report", "r1", cwd=tmp_path))
    assert (tmp_path / "r1/report.html").is_file()
    again = dtlab("train", *QUICK, "train.lr=0.3", "run.dir=r1", "run.overwrite=true", cwd=tmp_path)
    ok(again)
    assert not (tmp_path / "r1/report.html").exists()
    said = [x for x in again.stderr.splitlines() if x.startswith("dtlab: removed")]
    assert said == ["dtlab: removed the earlier run's report.html, metrics.jsonl, progress, "
                    "summary.json from run.dir 'r1' (this run starts over)"], again.stderr


@pytest.mark.parametrize("args", [["train", *QUICK, "run.dir=/"],
                                  ["compare", "--strategies", "single", "--out", "/"]])
def test_the_file_systems_root_is_no_output_directory(tmp_path: Path, args: list[str]) -> None:
    flag = "run.dir" if args[0] == "train" else "--out"
    line = refused(args, tmp_path)
    assert line == (f"dtlab: error: {flag} '/' is the file system's root; fix: a directory of its "
                    "own inside it (e.g. runs/NAME)")


def test_an_empty_value_and_a_bare_tilde_are_not_the_default_in_disguise(tmp_path: Path) -> None:
    assert refused(["train", *QUICK, "run.dir="], tmp_path) == (
        "dtlab: error: override 'run.dir=' gives run.dir no value; fix: run.dir=VALUE, or leave "
        "it out for its default")
    home = Path("~").expanduser()
    assert refused(["train", *QUICK, "run.dir=~"], tmp_path) == (
        f"dtlab: error: run.dir '{home}' is your home directory; fix: a directory of its own "
        "inside it (e.g. runs/NAME)")


# ----------------------------------------------------------- a second outside audit (154 cases)
@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_a_compare_or_sweep_inside_another_output_is_refused(tmp_path: Path, command: str) -> None:
    ok(dtlab("train", *QUICK, "train.checkpoint_every=1", "run.dir=r", cwd=tmp_path))
    (tmp_path / "s.yaml").write_text(f"base: {CONFIGS / 'quick.yaml'}\n"
                                     "overrides: {train.max_steps: 2}\nmatrix: {seed: [1]}\n")
    args = ["compare", "--strategies", "single", "train.max_steps=2"] if command == "compare" \
        else ["sweep", "s.yaml"]
    for inside in ("r/checkpoints", "r/cmp"):
        line = refused([*args, "--out", inside], tmp_path)
        assert line == (f"dtlab: error: --out '{inside}' is inside the output of dtlab run "
                        f"'{tmp_path / 'r'}', which that command may replace or delete and whose "
                        "results would count it in; fix: a directory outside it")


def test_a_users_run_json_with_a_status_is_still_the_users(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r/run.json").write_text('{"status": "mine"}\n')
    assert "holds run.json, which no dtlab run recorded" in refused(
        ["train", *QUICK, "run.dir=r"], tmp_path)


@pytest.mark.parametrize("args", [["compare", "--strategies", "single", "--out", ""],
                                  ["plot", "results.csv", "-o", ""],
                                  ["collect", "runs", "-o", ""]])
def test_an_empty_output_path_is_refused_not_read_as_here(tmp_path: Path, args: list[str]) -> None:
    flag = args[-2]
    assert refused(args, tmp_path) == (f"dtlab: error: {flag} is empty; fix: name a path, or "
                                       f"leave {flag} out for its default")


def test_a_continued_sweep_run_keeps_its_first_attempts_log(tmp_path: Path) -> None:
    """A sweep's run stopped and continued: train.log holds both attempts, as on SLURM."""
    from dtlab.sweeps.local import run_local

    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("dtlab: interrupted by SIGINT at step 519 (the first attempt)\n")
    status, reason, code = run_local([sys.executable, "-c", "print('second attempt'); exit(3)"],
                                     run, 60)
    assert (status, code) == ("failed", 3) and reason == "exit code 3: second attempt"
    assert (run / "train.log").read_text() == ("dtlab: interrupted by SIGINT at step 519 (the "
                                               "first attempt)\nsecond attempt\n")
