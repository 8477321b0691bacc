"""Checkpoints, resume, restarts, hangs, non-finite losses, resharding (CPU, gloo). Two nodes on
localhost: docs/guide/06-multi-node.md, run by tests/test_guide.py."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import ranks
import torch
from conftest import dtlab, step_losses, train
from safetensors.torch import load_file

from dtlab.run.checkpoint import MANIFEST, sha256, verify

STEPS = "train.max_steps=40"
CKPT = ("train.checkpoint_every=10", "run.timeout_s=30")


@pytest.fixture(scope="module")
def uninterrupted(session_dir: Path) -> Path:
    run = session_dir / "rel-uninterrupted"
    train(run, "strategy.name=ddp", STEPS, *CKPT, nproc=2)
    return run


def run_fails(run: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """A run that may fail, on real ranks (tests/ranks.py: dtlab's own rule picks the exit code)."""
    return ranks.train(nproc, "strategy.name=ddp", STEPS, *CKPT, *overrides, f"run.dir={run}",
                       "run.log_every=1", "run.progress=false")


def test_checkpoints_are_published_and_pruned(uninterrupted: Path) -> None:
    kept = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    assert kept == ["step_000030", "step_000040"]  # keep_checkpoints=2
    manifest = json.loads((uninterrupted / "checkpoints" / "step_000040" / MANIFEST).read_text())
    assert manifest["step"] == 40 and manifest["world_size"] == 2
    assert {"__0_0.distcp", ".metadata", "rng_rank0.json", "rng_rank1.json"} <= set(manifest["files"])


def test_stop_and_resume_mid_epoch_repeats_the_same_steps(uninterrupted: Path, session_dir: Path) -> None:
    run = session_dir / "rel-stopped"
    first = run_fails(run, "run.fault.kind=exit", "run.fault.step=25", "run.fault.rank=1")
    assert first.returncode == 17, first.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000010", "step_000020"]
    summary = train(run, "strategy.name=ddp", STEPS, *CKPT, nproc=2)  # resume=auto
    assert summary["resumed_from"]["step"] == 20  # mid-epoch: 64 steps per epoch
    assert summary["resumed_from"]["lost_steps"] == 4  # steps 21-24 ran before the stop
    ref, got = step_losses(uninterrupted), step_losses(run)
    assert len(got) == 40 and max(abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)) < 1e-6


def corrupt(ckpt: Path) -> Path:
    """One byte of rank 0's shard flipped."""
    shard = ckpt / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return ckpt


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """What the ranks said on stderr, less tests/ranks.py's note on a rank that said nothing."""
    return [x for x in proc.stderr.strip().splitlines() if not x.startswith("[rank ")]


SHA = "__0_0.distcp fails its sha256 check: it was modified or corrupted"


def test_resume_auto_skips_a_corrupt_latest_checkpoint(uninterrupted: Path, session_dir: Path) -> None:
    """resume=auto on 2 ranks skips a corrupt latest checkpoint with one warning and resumes the one before, equal to the uninterrupted run; none verifying is one error."""
    run = Path(shutil.copytree(uninterrupted, session_dir / "rel-corrupt-latest"))
    corrupt(run / "checkpoints" / "step_000040")
    proc = run_fails(run)  # 2 ranks, resume=auto
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [x for x in proc.stderr.splitlines() if "skipped" in x] == [
        f"dtlab: warning: skipped checkpoint step_000040 ({SHA}); resuming from step_000030, "
        "the newest that verifies"]
    assert f"resuming from {run}/checkpoints/step_000030 at step 30" in proc.stderr
    assert step_losses(run) == pytest.approx(step_losses(uninterrupted), rel=1e-6)
    assert verify(run / "checkpoints" / "step_000040")["step"] == 40  # saved again, good

    for name in ("step_000030", "step_000040"):  # none verifies: refused, nothing resumed silently
        corrupt(run / "checkpoints" / name)
    proc = run_fails(run)
    assert proc.returncode == 2 and error_lines(proc) == [
        f"dtlab: error: [rank 0] no checkpoint in '{run}/checkpoints' verifies: step_000040 "
        f"({SHA}); step_000030 ({SHA}); fix: restore a good copy, or start over with resume=none "
        "run.overwrite=true (deleting the earlier run in run.dir), or in another run.dir"]


def test_a_corrupt_checkpoint_named_by_resume_is_one_error(uninterrupted: Path, tmp_path: Path) -> None:
    """resume=PATH to a corrupt checkpoint on 2 ranks: exit 2, one line (not one per rank)."""
    ckpt = corrupt(Path(shutil.copytree(uninterrupted / "checkpoints" / "step_000030",
                                        tmp_path / "step_000030")))
    proc = run_fails(tmp_path / "run", f"resume={ckpt}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_lines(proc) == [f"dtlab: error: [rank 0] checkpoint '{ckpt}': {SHA}; fix: set resume to "
                                 "another checkpoint (RUN/checkpoints/step_N), or start over with resume=none"]


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(uninterrupted: Path, session_dir: Path) -> None:
    run = session_dir / "rel-killed-in-save"
    first = run_fails(run, "run.fault.kind=kill_in_save", "run.fault.step=20", "run.fault.rank=1")
    assert first.returncode != 0
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [".tmp-step_000020", "step_000010"]  # nothing half-written was published
    proc = run_fails(run)  # resume=auto
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ignoring incomplete checkpoint" in proc.stderr
    assert "resuming from" in proc.stderr and "step_000010 at step 10" in proc.stderr
    assert step_losses(run) == pytest.approx(step_losses(uninterrupted), rel=1e-6)
    assert not (run / "checkpoints" / ".tmp-step_000020").exists()  # cleaned by the next save


def test_resharding_2_to_4_to_1_ranks_preserves_parameters(session_dir: Path) -> None:
    base = ("train.max_steps=10", "train.checkpoint_every=10", "run.save_model=true")
    a, b, c, d, e = (session_dir / f"rel-reshard-{x}" for x in "abcde")
    train(a, "strategy.name=fsdp", *base, nproc=2)
    train(b, "strategy.name=fsdp", *base, f"resume={a}/checkpoints/step_000010", nproc=4)
    train(c, "strategy.name=single", *base, f"resume={b}/checkpoints/step_000010")
    train(d, "strategy.name=ddp", *base, f"resume={a}/checkpoints/step_000010", nproc=2)
    train(e, "strategy.name=fsdp1", *base, f"resume={a}/checkpoints/step_000010", nproc=2)
    proc = dtlab("export", str(c / "checkpoints" / "step_000010"), "-o", str(c / "export.safetensors"))
    assert proc.returncode == 0, proc.stderr
    ref = load_file(str(a / "model.safetensors"))
    for path in (b / "model.safetensors", c / "model.safetensors", d / "model.safetensors",
                 e / "model.safetensors", c / "export.safetensors"):
        got = load_file(str(path))
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), path


def test_a_hung_rank_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    t0 = time.perf_counter()  # the real command: torch elastic stops the hung rank
    proc = dtlab("train", "--nproc-per-node", "2", "strategy.name=ddp", "train.max_steps=20",
                 "run.timeout_s=5", "run.fault.kind=hang", "run.fault.step=5", "run.fault.rank=1",
                 f"run.dir={tmp_path}", "run.progress=false", real_launches=True)
    assert proc.returncode == 1
    assert time.perf_counter() - t0 < 5 + 30 + 15  # timeout + 30 s, plus start-up
    assert "a collective failed at step 5 on rank 0" in proc.stderr
    assert "rank(s) [1] stopped taking part" in proc.stderr
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    # Both ranks dumped their flight recorder: rank 0 on the timeout, rank 1 when it was stopped.
    assert sorted(p.name for p in (tmp_path / "flight_recorder").iterdir()) == [
        "rank0.json", "rank1.json"]
    seq = {r: json.loads((tmp_path / "flight_recorder" / f"rank{r}.json").read_text())
           ["entries"][-1]["collective_seq_id"] for r in (0, 1)}
    assert seq[0] == seq[1] + 1  # rank 0 entered one collective more: the one it waited in
    verdict = dtlab("doctor", "hang", str(tmp_path))
    assert verdict.returncode == 0, verdict.stderr
    # the verdict names rank 1, the collective's number and its op: DDP's gradient all-reduce
    assert (f"verdict: rank(s) [1] never entered collective #{seq[0]} (gloo:all_reduce, input "
            "[[136874]] Float (547,496 bytes)); rank(s) [0] entered it") in verdict.stdout
    assert f"collective #{seq[0]} (gloo:all_reduce, group 0:default_pg): missing ranks [1]" \
        in verdict.stdout  # PyTorch's own analysis agrees


# FSDP: the norm is reduced over the shards. DDP's stop is exercised by guide chapter 08
# (accumulation without loss division: "non-finite gradient (norm nan) at step 62", exit 1).
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_non_finite_loss_stops_and_the_checkpoint_stays_good(tmp_path: Path, strategy: str) -> None:
    nan = ("run.fault.kind=nan", "run.fault.step=12", "run.fault.rank=1", "train.checkpoint_every=5",
           "train.max_steps=20", f"strategy.name={strategy}")
    proc = ranks.train(2, *nan, f"run.dir={tmp_path / 'a'}", "run.progress=false")
    assert proc.returncode == 1 and "non-finite gradient (norm nan) at step 12" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "step_000005", "step_000010"]
    assert dtlab("export", str(tmp_path / "a" / "checkpoints" / "step_000010"), "-o",
                 str(tmp_path / "m.safetensors")).returncode == 0
    skipped = train(tmp_path / "b", *nan, "train.nan_policy=skip", nproc=2)
    assert skipped["skipped_steps"] == 1 and skipped["steps"] == 20
    assert torch.isfinite(torch.tensor(skipped["final_train_loss"]))


@pytest.fixture(scope="module")
def good_checkpoint(session_dir: Path) -> Path:
    run = session_dir / "rel-good"
    train(run, "train.max_steps=5", "train.checkpoint_every=5")
    return run / "checkpoints" / "step_000005"


def refused(tmp_path: Path, ckpt: Path, *overrides: str) -> str:
    proc = dtlab("train", f"resume={ckpt}", "train.max_steps=5", f"run.dir={tmp_path / 'r'}",
                 *overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "; fix: " in lines[0], lines[0]
    return lines[0]


def test_truncated_tampered_and_foreign_checkpoints_are_refused(good_checkpoint: Path, tmp_path: Path) -> None:
    def copy(name: str) -> Path:
        return Path(shutil.copytree(good_checkpoint, tmp_path / name))

    truncated = copy("truncated")
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "__0_0.distcp has" in refused(tmp_path, truncated) and "truncated" in refused(tmp_path, truncated)

    tampered = copy("tampered")
    raw = bytearray((tampered / "__0_0.distcp").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (tampered / "__0_0.distcp").write_bytes(bytes(raw))
    assert "fails its sha256 check" in refused(tmp_path, tampered)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"\0" * 64)
    assert "is not a complete dtlab checkpoint" in refused(tmp_path, foreign)
    assert "not found" in refused(tmp_path, tmp_path / "absent")

    other_model = refused(tmp_path, good_checkpoint, "model.channels=[8, 16]")
    assert "model.channels is [16, 32] in the checkpoint, [8, 16] here" in other_model


class _Exploit:
    def __reduce__(self):  # what a malicious .metadata would carry
        return (print, ("this must never run",))


def test_a_malicious_metadata_pickle_is_never_executed(good_checkpoint: Path, tmp_path: Path) -> None:
    evil = Path(shutil.copytree(good_checkpoint, tmp_path / "evil"))
    (evil / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    manifest = json.loads((evil / MANIFEST).read_text())  # an attacker fixes the checksums too
    manifest["files"][".metadata"] = {"bytes": (evil / ".metadata").stat().st_size,
                                      "sha256": sha256(evil / ".metadata")}
    (evil / MANIFEST).write_text(json.dumps(manifest))
    message = refused(tmp_path, evil)
    assert "refused metadata" in message and "is not allowed in checkpoint metadata" in message
    proc = dtlab("export", str(evil), "-o", str(tmp_path / "x.safetensors"))
    assert proc.returncode == 2 and "this must never run" not in proc.stdout + proc.stderr
