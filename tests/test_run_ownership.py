"""A run directory has one owner and one run (dtlab/run/owner.py, dtlab/run/dir_lock.py,
dtlab/owned.py): dtlab deletes only what a run recorded writing, a directory holding another run
or a user's files is refused whatever `resume` says, a second process on a live run directory
is refused, a finished run started again keeps its summary, missing checkpoints are said as what
they are, and a resume over changed data is refused. Each case: the exit code, the one line, and
the user's files byte-identical afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import dtlab
from test_bad_inputs import refused, snapshot
from test_text import TINY_GPT, text

QUICK = ["train.max_steps=2", "run.progress=false", "run.save_model=false"]


def trained(workspace: Path, *overrides: str) -> None:
    proc = dtlab("train", *QUICK, *overrides, cwd=workspace)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("resume", ["auto", "none"])
def test_a_users_files_under_a_runs_output_names_are_refused_whatever_resume_says(
        tmp_path: Path, resume: str) -> None:
    run = tmp_path / "r"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events").write_text("the user's own")
    (run / "model.safetensors").write_text("the user's weights")
    (run / "progress").write_text("the user's notes")
    said = refused(["train", *QUICK, "run.dir=r", f"resume={resume}"], tmp_path)
    assert said == ("dtlab: error: run.dir 'r' holds model.safetensors, progress, tb, which no "
                    "dtlab run recorded writing there and a run would replace; fix: move them "
                    "away, run.overwrite=true to delete them, or choose another run.dir"), said


def test_a_users_config_yaml_in_run_dir_is_refused_unless_the_run_reads_it(tmp_path: Path) -> None:
    """The run writes its resolved config to run.dir/config.yaml: a user's own file there
    would lose its comments and keys; a sweep's run reads its config from that very file."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("# my notes\ntrain: {max_steps: 1}\n")
    said = refused(["train", *QUICK, "run.dir=r"], tmp_path)
    assert said.startswith("dtlab: error: run.dir 'r' holds config.yaml, which no dtlab run "
                           "recorded writing there"), said
    proc = dtlab("train", "--config", "r/config.yaml", *QUICK, "run.dir=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_overwrite_deletes_a_runs_outputs_and_nothing_else(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "model.safetensors").write_text("the user's weights")
    (run / "notes.txt").write_text("kept")
    trained(tmp_path, "run.dir=r", "run.overwrite=true", "train.max_steps=1")
    assert (run / "notes.txt").read_text() == "kept"
    assert (run / "summary.json").is_file() and not (run / "model.safetensors").exists()


def test_another_run_in_the_same_directory_is_refused_not_started_over(tmp_path: Path) -> None:
    """The default resume=auto with no checkpoint used to start over, deleting the first run."""
    trained(tmp_path, "run.dir=r", "train.lr=0.1")
    said = refused(["train", *QUICK, "run.dir=r", "train.lr=0.2"], tmp_path)
    assert said.startswith("dtlab: error: run.dir 'r' holds an earlier run (metrics.jsonl, "
                           "summary.json) and no checkpoint to continue it from: it saved none "
                           "(stopped before its first, or train.checkpoint_every=0); resume=auto would start over and delete it; "
                           "fix: run.overwrite=true to start over"), said


def test_a_finished_run_started_again_says_so_and_keeps_its_summary(tmp_path: Path) -> None:
    args = [*QUICK, "run.dir=r", "train.checkpoint_every=2"]
    trained(tmp_path, *args[3:])
    before = snapshot(tmp_path)
    proc = dtlab("train", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dtlab: run.dir 'r' holds this run complete at step 2; its summary stands and nothing "
        "was written (to train on, raise train.max_steps; to start over, resume=none "
        "run.overwrite=true)"], proc.stderr
    assert snapshot(tmp_path) == before


def test_missing_checkpoints_are_said_as_what_they_are(tmp_path: Path) -> None:
    trained(tmp_path, "run.dir=r", "train.max_steps=4", "train.checkpoint_every=2")
    root = tmp_path / "r" / "checkpoints"
    cases = {"checkpoints/ was deleted (it had saved step 4)": lambda: None,
             "checkpoints/ was emptied (it had saved step 4)": root.mkdir,
             "step_000004 has no manifest (emptied or changed outside dtlab)":
                 lambda: (root / "step_000004").mkdir(),
             "its last save was cut short (only a .tmp- directory is left)":
                 lambda: os.rename(root / "step_000004", root / ".tmp-step_000006")}
    shutil.rmtree(root)
    for why, make in cases.items():
        make()
        said = refused(["train", *QUICK, "run.dir=r", "train.max_steps=4",
                        "train.checkpoint_every=2"], tmp_path)
        assert f"and no checkpoint to continue it from: {why}; resume=auto would start over" in \
            said, said


def test_an_emptied_checkpoint_beside_a_complete_one_is_named_not_called_interrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.rundir.checkpoints import complete_checkpoints

    root = tmp_path / "checkpoints"
    (root / "step_000004").mkdir(parents=True)
    (root / ".tmp-step_000006").mkdir()
    assert complete_checkpoints(tmp_path) == []
    assert capsys.readouterr().err.splitlines() == [
        f"dtlab: warning: ignoring incomplete checkpoint {root / '.tmp-step_000006'} (a save was "
        "interrupted)",
        f"dtlab: warning: ignoring checkpoint {root / 'step_000004'}: it has no "
        "dtlab-checkpoint.json (emptied or changed outside dtlab)"]


def test_a_second_process_on_a_live_run_directory_is_refused_and_sigkill_frees_it(
        tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-m", "dtlab", "train", "train.max_steps=1000000", "run.dir=r",
         "run.progress=false", "run.threads=1"], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "r" / "metrics.jsonl").exists():  # training: the lock is held
            assert owner.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        for resume in ("auto", "none"):
            proc = dtlab("train", *QUICK, "run.dir=r", f"resume={resume}", "run.overwrite=true",
                         cwd=tmp_path)
            said = proc.stderr.strip()
            assert proc.returncode == 2 and said == (
                f"dtlab: error: run.dir 'r' is in use by another dtlab run (pid {owner.pid}); "
                "fix: wait for it to end, or choose another run.dir"), said
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    trained(tmp_path, "run.dir=r", "resume=none", "run.overwrite=true", "train.max_steps=1")


def test_a_resume_over_changed_data_is_refused_naming_what_changed(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(text(300, seed=0))
    (tmp_path / "b.txt").write_text(text(300, seed=1))
    assert dtlab("prepare", "a.txt", "--out", "data", cwd=tmp_path).returncode == 0
    tiny = [*TINY_GPT, "data.name=tokens", "data.dir=data", "run.dir=r", "run.save_model=false",
            "train.max_steps=2", "train.checkpoint_every=2"]
    trained(tmp_path, *tiny)
    prepared = dtlab("prepare", "b.txt", "--out", "data", cwd=tmp_path)  # replaces its own output
    assert prepared.returncode == 0, prepared.stderr
    said = refused(["train", *tiny, "train.max_steps=4"], tmp_path)
    assert said.startswith("dtlab: error: checkpoint 'r/checkpoints/step_000002' was trained on "
                           "other data than data.dir 'data' holds now: train.bin (sha256), val.bin "
                           "(sha256) changed since"), said
