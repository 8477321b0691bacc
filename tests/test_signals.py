"""SIGINT (Ctrl-C) and SIGTERM to `dtlab train` on 2 ranks, `dtlab compare` and `dtlab sweep`:
one line, exit code 128 + the signal, no traceback from any process, no process of the run left
(checked by process group), a checkpoint saved on SIGTERM that resumes exactly.

The commands run as a user runs them (`python -m dtlab`, torch elastic for 2 ranks), each in a
session of its own; the signal goes to that process group, as a terminal's Ctrl-C does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CONFIGS, max_rel_dev, step_losses, train

from dtlab.process.interrupt import descendant_groups, live_groups

STEPS = 30
RUN = ("strategy.name=ddp", f"train.max_steps={STEPS}", "run.log_every=1", "run.progress=false")


def last_step(progress: Path) -> int:
    try:
        return int(progress.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def interrupt_at(args: list[str], progress: str | Path, sig: signal.Signals, cwd: Path,
                 at_step: int = 3) -> tuple[subprocess.CompletedProcess[str], set[int]]:
    """`dtlab ARGS` in a session of its own; once a progress file matching `progress` (a glob
    under cwd) says step >= at_step, `sig` to its process group. Returns the finished command
    and the process groups of every process it had started."""
    proc = subprocess.Popen([sys.executable, "-m", "dtlab", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    groups, deadline = {proc.pid}, time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        groups |= descendant_groups(proc.pid)
        if any(last_step(p) >= at_step for p in cwd.glob(str(progress))):
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before the signal:\n{proc.stderr.read()[-3000:]}"
    groups |= descendant_groups(proc.pid)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, out, err), groups


def assert_stopped(proc: subprocess.CompletedProcess[str], groups: set[int],
                   sig: signal.Signals, processes: int) -> re.Match[str]:
    """Exit code 128 + sig, no traceback, one line saying where, nothing left of the run."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 128 + sig, output[-3000:]
    assert "Traceback" not in output and "Exception" not in output, output[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dtlab: interrupted by {sig.name}"), lines
    # each process of the run was seen, in a group of its own (torch elastic's workers too)
    assert len(groups) == processes, groups
    assert live_groups(groups) == [], "processes of the run are left"
    where = re.search(r" at step (\d+); (?:(saved|last) checkpoint step (\d+)|no checkpoint yet)",
                      lines[0])
    assert where, lines[0]
    return where


@pytest.fixture(scope="module")
def uninterrupted(session_dir: Path) -> list[float]:
    run = session_dir / "sig-uninterrupted"
    train(run, *RUN, "train.checkpoint_every=1000", nproc=2)
    return step_losses(run)


def test_sigterm_on_2_rank_train_saves_a_checkpoint_and_resume_is_exact(
        tmp_path: Path, uninterrupted: list[float]) -> None:
    """SIGTERM to a 2-rank `dtlab train`: exit 143, one line, a checkpoint at the agreed step, run.json `interrupted`; the resumed run's losses equal the uninterrupted run's (1e-6)."""
    run = tmp_path / "run"
    proc, groups = interrupt_at(["train", "--nproc-per-node", "2", *RUN,
                                 "train.checkpoint_every=1000", f"run.dir={run}"],
                                "run/progress", signal.SIGTERM, tmp_path)
    where = assert_stopped(proc, groups, signal.SIGTERM, processes=3)  # launcher, 2 workers
    assert where and where[2] == "saved" and where[1] == where[3], proc.stderr
    step = int(where[1])
    assert 3 <= step < STEPS
    # checkpoint_every=1000: the only checkpoint is the one the signal asked for
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{step:06d}"]
    record = json.loads((run / "run.json").read_text())  # what collect and report show
    assert record["status"] == "interrupted" and record["returncode"] == 143
    assert record["reason"] == proc.stderr.strip().removeprefix("dtlab: ")
    summary = train(run, *RUN, "train.checkpoint_every=1000", nproc=2)  # resume=auto
    assert json.loads((run / "run.json").read_text())["status"] == "done"
    assert summary["resumed_from"]["step"] == step and summary["resumed_from"]["lost_steps"] == 0
    # the same per-step losses as without the stop (measured: identical)
    assert max_rel_dev(step_losses(run), uninterrupted) < 1e-6


def test_sigint_on_2_rank_train_stops_without_a_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C on a 2-rank `dtlab train`: exit 130, one line naming the step and the last periodic checkpoint, no traceback, nothing left."""
    proc, groups = interrupt_at(["train", "--nproc-per-node", "2", *RUN,
                                 "train.checkpoint_every=2", f"run.dir={tmp_path / 'run'}"],
                                "run/progress", signal.SIGINT, tmp_path)
    where = assert_stopped(proc, groups, signal.SIGINT, processes=3)
    step = int(where[1])
    # Ctrl-C saves nothing beyond the periodic checkpoints (every 2 steps here)
    assert int(where[3]) == step - step % 2 and (where[2] == "saved") == (step % 2 == 0)
    assert "resume=auto continues from it" in proc.stderr


def test_the_checkpoint_signal_saves_and_stops_2_ranks(tmp_path: Path) -> None:
    """run.checkpoint_signal=USR1 (for `sbatch --signal=USR1@90`) on 2 ranks: a checkpoint at the agreed step, exit 138.

    The launcher passes the signal on; the ranks save at the step they agree on and stop."""
    proc, groups = interrupt_at(["train", "--nproc-per-node", "2", *RUN,
                                 "train.checkpoint_every=1000", "run.checkpoint_signal=USR1",
                                 f"run.dir={tmp_path / 'run'}"], "run/progress", signal.SIGUSR1,
                                tmp_path)
    where = assert_stopped(proc, groups, signal.SIGUSR1, processes=3)
    assert where[2] == "saved" and (tmp_path / "run" / "checkpoints" / f"step_{int(where[1]):06d}"
                                    / "dtlab-checkpoint.json").is_file()


# Ctrl-C on 2 ranks (the launcher and its workers below compare); SIGTERM on `single`, which
# trains in the `dtlab train` process that compare started.
@pytest.mark.parametrize(("sig", "strategy"), [(signal.SIGINT, "ddp"), (signal.SIGTERM, "single")],
                         ids=["SIGINT-ddp", "SIGTERM-single"])
def test_signal_to_compare_stops_the_running_strategy(tmp_path: Path, sig: signal.Signals,
                                                      strategy: str) -> None:
    """A signal to `dtlab compare` reaches the running strategy's processes: its one line, compare's exit 130/143, no table, nothing left; the line says that compare does not resume the checkpoint it saved (not "resume=auto continues from it")."""
    proc, groups = interrupt_at(["compare", "--strategies", strategy, "--out", str(tmp_path / "c"),
                                 f"train.max_steps={STEPS}", "train.checkpoint_every=1000"],
                                f"c/{strategy}/progress", sig, tmp_path)
    # compare, its `dtlab train` and, on 2 ranks, torch elastic's 2 workers
    where = assert_stopped(proc, groups, sig, processes=4 if strategy == "ddp" else 2)
    assert where[2] == ("saved" if sig == signal.SIGTERM else None), proc.stderr
    if sig == signal.SIGTERM:
        assert where[1] == where[3] and proc.stderr.strip().endswith(
            "; compare does not resume: run again, it trains every strategy anew"), proc.stderr
    assert not (tmp_path / "c" / "compare.csv").exists()  # no table from a stopped comparison


SWEEP = """
base: {base}
overrides: {{train.max_steps: {steps}, train.checkpoint_every: 1000, strategy.name: ddp}}
matrix:
  nproc_per_node: [{nproc}]
  train.lr: [0.05, 0.02]
timeout_s: 240
"""


@pytest.mark.parametrize(("sig", "nproc"), [(signal.SIGINT, 1), (signal.SIGTERM, 2)],
                         ids=["SIGINT-1-rank", "SIGTERM-2-ranks"])
def test_signal_to_a_sweep_stops_its_run_and_records_it(tmp_path: Path, sig: signal.Signals,
                                                        nproc: int) -> None:
    """A signal to `dtlab sweep`: the running run stops (checkpoint on SIGTERM), its run.json says `interrupted`, one line, exit 130/143, nothing left."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SWEEP.format(base=CONFIGS / "quick.yaml", steps=STEPS, nproc=nproc))
    proc, groups = interrupt_at(["sweep", str(spec), "--out", str(tmp_path / "o")],
                                "o/runs/*/progress", sig, tmp_path)
    where = assert_stopped(proc, groups, sig, processes=2 if nproc == 1 else 4)
    assert f"run 'nproc_per_node={nproc} train.lr=0.05' stopped at step" in proc.stderr
    assert f"`dtlab sweep {spec} --out {tmp_path / 'o'}` continues the sweep" in proc.stderr
    assert where[2] == ("saved" if sig == signal.SIGTERM else None), proc.stderr
    records = [json.loads(p.read_text()) for p in (tmp_path / "o").glob("runs/*/run.json")]
    statuses = sorted((r["combo"]["train.lr"], r["status"]) for r in records)
    assert statuses == [(0.02, "planned"), (0.05, "interrupted")]
    stopped = next(r for r in records if r["status"] == "interrupted")
    assert stopped["returncode"] == 128 + sig and f"interrupted by {sig.name}" in stopped["reason"]

