"""A run directory belongs to one run (issue 26): resume=none never mixes with an earlier run,
resume continues only a run of the same config, a run directory that disappears stops the run,
and every stop hint says what really continues. Tiny runs: 1 rank in this process, 2 real gloo
ranks where the ranks must agree."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ranks
from conftest import dtlab

from dtlab.run.checkpoint import MANIFEST
from dtlab.run.dir_watch import DirectoryWatch
from dtlab.run.save_failure import SaveFailure

TINY = ("model.channels=[4]", "model.hidden=8", "data.synthetic.image_size=8",
        "data.synthetic.train_samples=256", "data.synthetic.val_samples=64",
        "train.global_batch_size=8", "run.log_every=1", "run.progress=false",
        "run.timing_warmup_steps=1")
CKPT = ("train.checkpoint_every=2",)
OVER = ("start over with resume=none run.overwrite=true (deleting the earlier run in run.dir), "
        "or in another run.dir")


def train(run: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return dtlab("train", *TINY, *overrides, f"run.dir={run}")


def errors(proc: subprocess.CompletedProcess[str], code: int) -> list[str]:
    """stderr's lines, checked: the exit code and no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    return [x for x in proc.stderr.splitlines() if x.strip()]


def snapshot(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def manifest(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step:06d}" / MANIFEST).read_text())


def logged_steps(run: Path) -> list[int]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 6 steps with checkpoints at steps 4 and 6 (keep_checkpoints=2)."""
    run = tmp_path_factory.mktemp("run-dir") / "earlier"
    errors(train(run, *CKPT, "train.max_steps=6"), 0)
    return run


@pytest.fixture
def run(earlier: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(earlier, tmp_path / "run"))


def test_resume_none_beside_an_earlier_run_is_refused(run: Path) -> None:
    """resume=none in a run directory holding an earlier run's checkpoints: exit 2, one line naming run.overwrite=true, the earlier run's files untouched."""
    before = snapshot(run)
    assert errors(train(run, *CKPT, "train.max_steps=4", "resume=none"), 2) == [
        f"dtlab: error: run.dir '{run}' holds an earlier run (checkpoints up to step 6, "
        "metrics.jsonl, summary.json), which resume=none would mix with this one; fix: "
        "run.overwrite=true to delete it and start over, resume=auto to continue it, or set "
        "another run.dir"]
    assert snapshot(run) == before


def test_overwrite_replaces_the_earlier_run_and_keeps_the_new_checkpoints(run: Path) -> None:
    """resume=none run.overwrite=true: the earlier run's files go, the new run's checkpoints are all kept (none pruned for the older steps), and resume=auto continues the new run."""
    old_id = manifest(run, 6)["run"]["id"]
    errors(train(run, *CKPT, "train.max_steps=4", "resume=none", "run.overwrite=true"), 0)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    ids = {manifest(run, s)["run"]["id"] for s in (2, 4)}
    assert len(ids) == 1 and old_id not in ids  # one new run
    assert logged_steps(run) == [1, 2, 3, 4]  # nothing of the earlier run's metrics
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    lines = errors(train(run, *CKPT, "train.max_steps=6"), 0)  # resume=auto: the new run
    assert lines == [f"dtlab: resuming from {run}/checkpoints/step_000004 at step 4; steps lost "
                     "since that checkpoint: 0",
                     "dtlab: warning: the cosine learning-rate schedule now spans 6 steps, not the "
                     "4 the checkpoint was trained for: from step 5 the learning rate is a 6-step "
                     "run's, not where the earlier run was heading"]
    assert manifest(run, 6)["run"]["id"] in ids and logged_steps(run) == [1, 2, 3, 4, 5, 6]


def test_resume_with_another_config_is_refused_naming_the_keys(run: Path) -> None:
    """resume=auto with train.lr and seed changed: exit 2 before training, one line naming both keys with their values and how to start over; the run's files untouched."""
    before = snapshot(run)
    assert errors(train(run, *CKPT, "train.max_steps=8", "train.lr=0.1", "seed=1"), 2) == [
        f"dtlab: error: checkpoint '{run}/checkpoints/step_000006' does not match this run: seed "
        "is 0 in the checkpoint, 1 here; train.lr is 0.05 in the checkpoint, 0.1 here; only how "
        "long, how often and where it runs may change on resume "
        f"(docs/reliability.md#one-run-per-directory); fix: resume with the config it was "
        f"written with, or {OVER}"]
    assert snapshot(run) == before


def test_a_resume_with_a_longer_run_and_other_cadences_continues_the_same_run(run: Path) -> None:
    """resume=auto with train.max_steps, eval, log and checkpoint cadence changed: it resumes, and its checkpoints carry the same run id and fingerprint."""
    record = manifest(run, 6)["run"]
    lines = errors(train(run, "train.checkpoint_every=1", "train.max_steps=8", "train.eval_every=2",
                         "train.keep_checkpoints=3", "run.log_every=2"), 0)
    assert lines[0].startswith(f"dtlab: resuming from {run}/checkpoints/step_000006 at step 6")
    assert manifest(run, 8)["run"] == record


def test_a_checkpoint_without_a_run_record_resumes_with_a_warning(run: Path) -> None:
    """A checkpoint written before runs were recorded (no `run` in its manifest) resumes after its config is checked, with one warning line."""
    for step in (4, 6):
        path = run / "checkpoints" / f"step_{step:06d}" / MANIFEST
        body = json.loads(path.read_text())
        del body["run"]
        path.write_text(json.dumps(body))
    lines = errors(train(run, *CKPT, "train.max_steps=8"), 0)
    assert lines[0] == (f"dtlab: warning: checkpoint {run}/checkpoints/step_000006 records no "
                        "run id (written before dtlab recorded them); its config matches, so it "
                        "is continued as this run")
    assert lines[1].startswith("dtlab: resuming from") and len(lines) == 3  # + the schedule's
    assert len(manifest(run, 8)["run"]["id"]) == 12


def test_resuming_a_checkpoint_into_a_directory_of_another_run_is_refused(
        earlier: Path, run: Path, tmp_path: Path) -> None:
    """resume=PATH of one run into a run.dir holding another run: exit 2, one line, both untouched; with run.overwrite=true the other run is replaced by the resumed one."""
    other = Path(shutil.copytree(earlier, tmp_path / "other"))
    for step in (4, 6):  # another run: another id
        path = other / "checkpoints" / f"step_{step:06d}" / MANIFEST
        path.write_text(path.read_text().replace(manifest(other, 6)["run"]["id"], "0123456789ab"))
    before = snapshot(run), snapshot(other)
    ckpt = other / "checkpoints" / "step_000006"
    assert errors(train(run, "train.max_steps=8", f"resume={ckpt}"), 2) == [
        f"dtlab: error: run.dir '{run}' holds an earlier run (checkpoints up to step 6, "
        f"metrics.jsonl, summary.json), which resuming '{ckpt}' there would mix with it; fix: "
        "run.overwrite=true to delete it, or set another run.dir"]
    assert (snapshot(run), snapshot(other)) == before
    errors(train(run, *CKPT, "train.max_steps=8", f"resume={ckpt}", "run.overwrite=true"), 0)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000008"]
    assert manifest(run, 8)["run"]["id"] == "0123456789ab"  # the resumed run goes on here
    assert logged_steps(run) == [7, 8] and snapshot(other) == before[1]


def delete_when(run: Path, step: int, replace: bool = False) -> threading.Thread:
    """A thread that deletes (or replaces) `run` once its progress file says `step`."""
    def act() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if int((run / "progress").read_text().split()[0]) >= step:
                    break
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.002)
        if replace:
            run.rename(run.with_name("moved"))
            run.mkdir()
        else:
            shutil.rmtree(run)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


GONE = (r"dtlab: error: {rank}run.dir '{run}' {what} during the run; it stopped after step "
        r"(\d+) and wrote nothing more; fix: leave run.dir in place while a run uses it \(to start "
        r"over, run.overwrite=true or another run.dir\)")


@pytest.mark.parametrize("deleted", [True, False], ids=["run.dir-deleted", "a-file-missing"])
def test_a_save_that_loses_a_file_says_whether_the_run_directory_went(tmp_path: Path,
                                                                       deleted: bool) -> None:
    """A checkpoint write that finds a file missing while the run directory is being deleted
    (rmtree empties it before it removes it) says the directory was deleted, not the save's
    ENOENT; with the directory still there after the grace, the save's own error."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    watch = DirectoryWatch(run)
    watch.start()
    failure = SaveFailure(run, 5, {}, SimpleNamespace(rank=0, world_size=1, is_main=True), watch)
    if deleted:
        threading.Timer(0.2, shutil.rmtree, args=(run,)).start()
    line = failure.explain(FileNotFoundError(errno.ENOENT, "No such file or directory"))
    if deleted:
        assert line == watch.line(5, "was deleted")
    else:
        assert line.startswith("No such file or directory while writing checkpoint step 5 to ")


@pytest.mark.parametrize("replace", [False, True], ids=["deleted", "replaced"])
def test_a_run_directory_that_disappears_mid_run_stops_it(tmp_path: Path, replace: bool) -> None:
    """The run directory deleted, or replaced by another, while the run trains: exit 1, one line, the run stops at the next step and nothing recreates or writes into the directory."""
    run = tmp_path / "run"
    thread = delete_when(run, 3, replace)
    lines = errors(train(run, "train.max_steps=3000", "train.checkpoint_every=5"), 1)
    thread.join()
    # (a step boundary between the rename and the mkdir sees it deleted: also one line)
    what = "was (?:replaced by another directory|deleted)" if replace else "was deleted"
    said = [re.fullmatch(GONE.format(rank="", run=re.escape(str(run)), what=what), x) for x in lines]
    assert len(lines) == 1 and said[0] and 3 <= int(said[0][1]) < 100, lines
    if replace:
        assert list(run.iterdir()) == []  # the new directory is left as it was
        assert (tmp_path / "moved" / "config.yaml").is_file()
    else:
        assert not run.exists()


def test_the_directory_watch_tells_deleted_from_replaced(tmp_path: Path) -> None:
    """The run directory's watch: unchanged is no problem, another directory at its path is "replaced", none is "deleted"."""
    from dtlab.run.dir_watch import DirectoryWatch

    run = tmp_path / "run"
    run.mkdir()
    watch = DirectoryWatch(run)
    watch.start()
    assert watch.problem() is None and watch.intact()
    run.rename(tmp_path / "moved")
    assert watch.problem() == "was deleted"
    run.mkdir()
    assert watch.problem() == "was replaced by another directory" and not watch.intact()


def test_a_checkpoint_whose_directory_is_deleted_while_it_is_written_makes_nothing_again(
        tmp_path: Path) -> None:
    """The shards of a checkpoint go into the directory dtlab made; if the run directory is
    deleted between that and DCP's write, the write fails instead of making the run directory
    again (DCP's own writer makes every missing parent: the run then saw its directory
    "replaced", and a deleted run directory came back with a checkpoint in it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from dtlab.run.checkpoint import shard_writer

    run = tmp_path / "run"
    tmp = run / "checkpoints" / ".tmp-step_000005"
    tmp.mkdir(parents=True)
    shutil.rmtree(run)  # after dtlab made the directory, before DCP writes into it
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"w": torch.ones(4)}, storage_writer=shard_writer(tmp))
    assert "No such file or directory" in str(failed.value), failed.value
    assert not run.exists()
    tmp.mkdir(parents=True)  # and where the directory is there, the shards land in it
    dcp.save({"w": torch.ones(4)}, storage_writer=shard_writer(tmp))
    assert sorted(p.name for p in tmp.iterdir()) == [".metadata", "__0_0.distcp"]


def test_a_run_directory_deleted_under_2_ranks_stops_both(tmp_path: Path) -> None:
    """The run directory deleted under 2 ddp ranks: both stop at the same step (one agreement), exit 1, rank 0's one line, no hang, nothing recreated."""
    run = tmp_path / "run"
    thread = delete_when(run, 3)
    proc = ranks.train(2, "strategy.name=ddp", *TINY, "train.max_steps=3000", "run.timeout_s=30",
                       f"run.dir={run}", timeout=120)
    thread.join()
    # besides the launcher's summary line of a failed rank, as every exit-1 failure has
    lines = [x for x in errors(proc, 1)
             if not x.startswith(("[rank ", "dtlab: error: worker rank 0 failed"))]
    pattern = GONE.format(rank=r"\[rank 0\] ", run=re.escape(str(run)), what="was deleted")
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), proc.stderr[-2000:]
    assert not run.exists()


def test_the_sweeps_stop_hint_repeats_every_option_it_needs() -> None:
    """A stopped sweep's "run it again" command keeps --out, the launcher, --timeout and --requeue."""
    from dtlab.sweeps import rerun_command

    assert rerun_command("s.yaml", "local", None, None, False) == "dtlab sweep s.yaml"
    assert rerun_command("s.yaml", "slurm", "my out", 900.0, True) == (
        "dtlab sweep s.yaml --launcher slurm --out 'my out' --timeout 900 --requeue")


def test_the_run_reports_checkpoint_note_names_the_command_that_continues(run: Path) -> None:
    """The run report's note on the latest checkpoint names a command that continues it, whoever started the run."""
    from dtlab.results.run_report import file_links

    links = "".join(file_links(run, run / "report.html"))
    assert (f"`dtlab train --config {run}/config.yaml resume=auto run.dir={run}` continues from "
            "it") in links
    lines = errors(dtlab("train", "--config", str(run / "config.yaml"), "resume=auto",
                         f"run.dir={run}", "train.max_steps=7"), 0)  # followed: it continues
    assert lines[0].startswith(f"dtlab: resuming from {run}/checkpoints/step_000006 at step 6")
