"""Filesystem faults: the run directory, the data directory, a full disk while saving a checkpoint
or writing metrics, `export -o`; and `dtlab compare` run twice in one directory.

Each fault ends in one line naming the path, the cause and the fix: exit 2 before training, exit 1
during it, and the previous checkpoint stays loadable (a rerun resumes from it). A full disk is a
small tmpfs (root and mount needed); a file-size limit (RLIMIT_FSIZE, which every machine allows)
covers the same write failure without root.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ranks
from conftest import dtlab, fast_launches, step_losses, train

# constant LR: a run stopped at step 5 and resumed to 10 equals one run of 10 steps
RUN = ("train.checkpoint_every=5", "train.schedule=constant", "run.log_every=1", "run.progress=false")
CKPT_MB = 1.1  # the quick model's checkpoint (parameters and SGD momentum), measured


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one error line on stderr, checked: the exit code, no traceback, nothing else but
    "resuming from", for exit 1 the launcher's summary naming the worker's exit code, and
    tests/ranks.py's note that a rank printed nothing ("exit N before its output was set up")."""
    quiet_rank = re.compile(r"^\[rank \d+: exit [12] before its output was set up\]$")
    lines = [x for x in proc.stderr.strip().splitlines()
             if not x.startswith(("dtlab: resuming from", "dtlab: error: worker rank 0 failed"))
             and not quiet_rank.match(x)]
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def mount_tmpfs(where: Path, options: str) -> str | None:
    """Mount a tmpfs at `where`; the reason when this machine does not allow it."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return "mounting a tmpfs needs root"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode:
        return proc.stderr.strip() or f"mount exit {proc.returncode}"
    return None


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB file system of its own (a tmpfs), filled up by fill()."""
    disk = tmp_path / "disk"
    why = mount_tmpfs(disk, "size=4m")
    if why:
        pytest.skip(f"no small disk: {why}; test_file_size_limit_while_saving_a_checkpoint covers the failed write")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Leave `leave` bytes free on `disk` (rounded to its blocks)."""
    ballast = disk / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return ballast


DISK_FULL = re.compile(
    r"^dtlab: error: (\[rank 0\] )?no space left on device while writing (rank \d's part of )?"
    r"checkpoint step 10 to '(?P<root>[^']+)' \(needs ~(?P<needs>[\d.]+) MB, (?P<free>[\d.]+) MB "
    r"free\); step 5 is intact \(resume=auto continues from it\); fix: free space on that disk, "
    r"or set run.dir to a path on another one$")


def test_disk_full_while_saving_a_checkpoint(small_disk: Path, tmp_path: Path) -> None:
    """A full disk while saving checkpoint 10: exit 1, one line with what it needs; step 5 stays and the rerun resumes from it, equal to an uninterrupted run."""
    run = small_disk / "run"
    train(run, *RUN, "train.max_steps=5")
    ballast = fill(small_disk, 300_000)
    proc = dtlab("train", *RUN, "train.max_steps=10", f"run.dir={run}")  # resumes at 5
    m = DISK_FULL.match(one_line(proc, 1))
    assert m and m["root"] == str(run / "checkpoints"), proc.stderr
    assert float(m["needs"]) == pytest.approx(CKPT_MB, abs=0.1) and float(m["free"]) < 0.4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000005"]
    ballast.unlink()
    summary = train(run, *RUN, "train.max_steps=10")  # resume=auto: from the intact step 5
    assert summary["resumed_from"]["step"] == 5 and summary["steps"] == 5
    whole = train(tmp_path / "whole", *RUN, "train.max_steps=10")
    assert summary["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-6)
    assert step_losses(run) == pytest.approx(step_losses(tmp_path / "whole"), rel=1e-6)


def test_disk_full_on_2_ranks_is_said_once(small_disk: Path) -> None:
    """A full disk while 2 FSDP ranks save: every rank stops at once (no timeout), the line comes once, the previous checkpoint stays."""
    run = small_disk / "run"
    args = ("strategy.name=fsdp", *RUN, f"run.dir={run}")
    assert ranks.train(2, *args, "train.max_steps=5").returncode == 0
    ballast = fill(small_disk, 300_000)
    t0 = time.perf_counter()
    proc = ranks.train(2, *args, "train.max_steps=10", timeout=60)
    assert time.perf_counter() - t0 < 30  # no rank waits for the others' timeout
    assert DISK_FULL.match(one_line(proc, 1)), proc.stderr
    assert proc.stderr.count("no space left") == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000005"]
    ballast.unlink()  # (resuming from it: the 1-rank test above)


def test_disk_full_while_writing_metrics(small_disk: Path) -> None:
    """A full disk while writing metrics.jsonl: exit 1, one line naming the file and step; the records that fitted stay, whole."""
    run = small_disk / "run"
    fill(small_disk, 4 * 4096)  # the run's record, config.yaml, progress, a block of metrics
    proc = dtlab("train", "train.max_steps=60", "run.log_every=1", "run.progress=false",
                 f"run.dir={run}")
    line = one_line(proc, 1)
    assert re.match(rf"^dtlab: error: no space left on device while writing '{run}/metrics.jsonl' "
                    r"at step \d+; no checkpoint was written yet \(train.checkpoint_every sets "
                    r"how often\); fix: free space on that disk, or set run.dir to a path on "
                    r"another one$", line), line
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert 10 < len(records) < 60  # what fitted is there, whole lines


def _train_with_a_file_size_limit(argv: list[str]) -> int:
    """A rank of `dtlab train` under a 600 kB file-size limit (RLIMIT_FSIZE; Python ignores
    SIGXFSZ, so a write beyond it fails with EFBIG)."""
    from dtlab.train import main

    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))
    return main(argv)


def test_file_size_limit_while_saving_a_checkpoint(tmp_path: Path) -> None:
    """A file-size limit (ulimit -f, EFBIG) while saving: exit 1, one line naming the limit; step 5 stays and the rerun resumes from it."""
    run = tmp_path / "run"
    train(run, *RUN, "train.max_steps=5")
    proc = ranks.start(1, [*RUN, "train.max_steps=10", f"run.dir={run}"],
                       target=_train_with_a_file_size_limit)
    assert one_line(proc, 1) == (
        "dtlab: error: file too large for the file-size limit (ulimit -f) while writing checkpoint "
        f"step 10 to '{run / 'checkpoints'}' (needs ~{CKPT_MB} MB, file-size limit 0.6 MB); step 5 "
        "is intact (resume=auto continues from it); fix: raise the limit (ulimit -f unlimited), "
        "or set run.dir elsewhere")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000005"]
    assert train(run, *RUN, "train.max_steps=10")["resumed_from"]["step"] == 5


def _train_with_a_100_kb_file_limit(argv: list[str]) -> int:
    from dtlab.train import main

    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    return main(argv)


def test_file_size_limit_while_saving_the_model(tmp_path: Path) -> None:
    """run.save_model beyond a file-size limit: exit 1, one line naming the file; no partial file left."""
    run = tmp_path / "run"
    proc = ranks.start(1, ["train.max_steps=2", "run.save_model=true", "run.progress=false",
                           f"run.dir={run}"], target=_train_with_a_100_kb_file_limit)
    assert one_line(proc, 1) == (
        "dtlab: error: file too large for the file-size limit (ulimit -f) while writing "
        f"run.save_model's '{run / 'model.safetensors'}'; fix: raise the limit (ulimit -f "
        "unlimited), or set run.dir elsewhere")
    assert not list(run.glob("*model.safetensors*"))  # nor its temporary file


# ------------------------------------------------------------------ before training: exit 2
FIX = "fix: set {key} to a directory path, or move the file out of the way"
UNUSABLE = {  # overrides ({file}: a file, {tmp}: an empty directory) -> the message
    "run.dir is a file": (["run.dir={file}"],
                          "run.dir '{file}' is a file, not a directory; " + FIX),
    "run.dir is inside a file": (["run.dir={file}/run"], "run.dir '{file}/run' is inside '{file}', "
                                 "which is a file, not a directory; " + FIX),
    "data.dir is a file": (["data.name=cifar10", "data.dir={file}"],
                           "data.dir '{file}' is a file, not a directory; " + FIX),
    "data.dir is inside a file, download on": (
        ["data.name=mnist", "data.download=true", "data.dir={file}/d"],
        "data.dir '{file}/d' is inside '{file}', which is a file, not a directory; " + FIX),
    "token files missing": (["model.name=gpt", "data.name=tokens", "data.dir={tmp}"],
                            "token file {tmp}/train.bin not found; fix: write it with `dtlab "
                            "prepare TEXT --out {tmp}`, or point data.dir at a directory holding "
                            "train.bin"),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_unusable_run_or_data_directory(tmp_path: Path, case: str) -> None:
    """A run or data directory that cannot be one: exit 2 and one line before anything trains; the file in the way is untouched."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    overrides, message = UNUSABLE[case]
    key = "data.dir" if case.startswith("data") else "run.dir"
    fill_in = {"file": a_file, "tmp": tmp_path, "key": key}
    args = [o.format(**fill_in) for o in overrides]
    proc = dtlab("train", "train.max_steps=2", f"run.dir={tmp_path / 'r'}", *args)
    assert one_line(proc, 2) == "dtlab: error: " + message.format(**fill_in)
    assert a_file.read_text() == "not a directory"


def test_an_unusable_run_directory_on_2_ranks_is_said_once(tmp_path: Path) -> None:
    """run.dir is a file, on 2 ranks: rank 0 says it once, exit 2, no rank starts training."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    proc = ranks.train(2, "strategy.name=ddp", f"run.dir={a_file}")
    assert one_line(proc, 2) == (f"dtlab: error: run.dir '{a_file}' is a file, not a directory; "
                                 + FIX.format(key="run.dir"))
    assert "[METRIC]" not in proc.stdout


def test_a_read_only_run_directory(tmp_path: Path) -> None:
    """A read-only run directory (a read-only mount; without root, permissions): exit 2, one line."""
    ro = tmp_path / "ro"
    why = mount_tmpfs(ro, "size=1m,ro")
    if why and os.geteuid() == 0:
        pytest.skip(f"no read-only mount ({why}), and root ignores permissions")
    if why:  # without root, permissions do the same
        ro.chmod(0o555)
    try:
        line = one_line(dtlab("train", f"run.dir={ro}/run"), 2)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False, capture_output=True) if not why \
            else ro.chmod(0o755)
    cause = "permission denied" if why else "read-only file system"
    assert line == (f"dtlab: error: {cause} while creating a file in run.dir '{ro}/run'; "
                    "fix: make it writable, or set run.dir to a writable directory")


def test_export_output_checks(tmp_path: Path) -> None:
    """`dtlab export -o` a directory, or inside a file: exit 2, one line, before anything is loaded."""
    run = tmp_path / "run"
    train(run, *RUN, "train.max_steps=5")
    ckpt = str(run / "checkpoints" / "step_000005")
    (tmp_path / "a_file").write_text("x")
    assert one_line(dtlab("export", ckpt, "-o", str(tmp_path)), 2) == (
        f"dtlab: error: -o/--output '{tmp_path}' is a directory; fix: name a file in it, e.g. "
        f"--output {tmp_path / 'model.safetensors'}")
    inside = tmp_path / "a_file" / "m.safetensors"
    assert one_line(dtlab("export", ckpt, "-o", str(inside)), 2) == (
        f"dtlab: error: -o/--output '{inside}': '{tmp_path / 'a_file'}' is a file, not a "
        "directory; fix: choose another path")


# ----------------------------------------------------------------------------- compare twice
def test_compare_twice_in_one_directory_starts_fresh_runs(tmp_path: Path) -> None:
    """`dtlab compare` twice in one directory, then with another optimizer: three correct tables, every run trained anew."""
    base = ("--strategies", "single,ddp", "--out", str(tmp_path / "cmp"), "train.max_steps=2",
            "run.timing_warmup_steps=1")

    def table(*overrides: str) -> dict[str, dict]:
        with fast_launches():
            proc = dtlab("compare", *base, *overrides)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        rows = {r["strategy"]: r for r in json.loads((tmp_path / "cmp" / "compare.json").read_text())}
        for label in ("single", "ddp"):
            summary = json.loads((tmp_path / "cmp" / label / "summary.json").read_text())
            assert summary["steps"] == 2 and "resumed_from" not in summary  # trained anew
            assert rows[label]["samples_per_s"] > 0
            assert rows[label]["final_loss"] == round(summary["final_train_loss"], 6)
        # single and ddp (2 ranks) train the same model on the same global batches
        assert rows["ddp"]["final_loss"] == pytest.approx(rows["single"]["final_loss"], rel=1e-5)
        return rows

    # Before, the second table resumed the finished runs (0 steps: a TypeError in row_for, also
    # with train.lr changed) and the third was refused ("does not match this run").
    first = table()
    again = table()  # the same config: measured again, the same losses
    assert again["single"]["final_loss"] == first["single"]["final_loss"]
    changed = table("train.optimizer=adamw", "train.lr=0.001")
    assert changed["single"]["final_loss"] != first["single"]["final_loss"]


def test_compare_row_of_a_run_without_timed_steps() -> None:
    """A compare row for a run without timed steps has empty speed cells instead of a TypeError."""
    from dtlab.cli.compare import row_for

    summary = {"world_size": 1, "samples_per_s": None, "median_step_time_s": None,
               "final_train_loss": 2.3, "val_acc": None,
               "memory_per_rank": {"peak_rss_bytes": [2 ** 20], "param_bytes": [4], "grad_bytes": [4],
                                   "optim_bytes": [4]}}
    row = row_for("single", summary)
    assert row["samples_per_s"] is None and row["step_time_ms"] is None and row["final_loss"] == 2.3
