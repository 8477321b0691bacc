"""DeepSpeed checkpoints (strategy deepspeed, ZeRO 1, 2 and 3 on 2 real gloo ranks): a run resumed
from its checkpoint of the middle step continues exactly as the run that never stopped (per-step
losses, final weights and every saved tensor, optimizer partitions included); `dtlab export` turns
a deepspeed checkpoint into the run's model; a resume under another ZeRO stage, world size,
partitioning or strategy is refused with one line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ranks
import torch
from conftest import dtlab, needs, step_losses, train
from safetensors.torch import load_file

from dtlab.run.checkpoint import MANIFEST, _safe_reader, dcp_load

pytestmark = needs("deepspeed", "deepspeed")

STAGES = (1, 2, 3)
STEPS, MID = 6, 3
# A tiny CNN on 8x8 images, AdamW with warmup and cosine decay (the schedule is restored, not
# recomputed), active clipping: the state a resume must bring back is all there, in ~1 s a run.
TINY = ("strategy.name=deepspeed", "model.channels=[4,8]", "model.hidden=16",
        "data.synthetic.train_samples=256", "data.synthetic.val_samples=32",
        "data.synthetic.image_size=8", "train.global_batch_size=16", "train.optimizer=adamw",
        "train.lr=0.01", "train.warmup_steps=2", "train.grad_clip=0.05", f"train.max_steps={STEPS}",
        f"train.checkpoint_every={MID}", "run.save_model=true")


def stage(s: int) -> str:
    return f"strategy.deepspeed.zero_stage={s}"


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, by its flattened key, read in this process."""
    meta = _safe_reader()(str(path)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp_load(tensors, path)
    return tensors


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One run per stage of STEPS steps, checkpointed at MID and at the end."""
    root = tmp_path_factory.mktemp("ds-ckpt")
    runs = {s: root / f"zero{s}" for s in STAGES}
    for s, run in runs.items():
        train(run, *TINY, stage(s), nproc=2)
    return runs


@pytest.mark.parametrize("s", STAGES)
def test_resume_equals_the_uninterrupted_run(s: int, uninterrupted: dict[int, Path],
                                             tmp_path: Path) -> None:
    """Resumed (resume=auto) from the middle checkpoint: the same losses, weights and saved state,
    exactly."""
    ref = uninterrupted[s]
    shutil.copytree(checkpoint(ref, MID), checkpoint(tmp_path, MID))  # as a stopped run leaves it
    summary = train(tmp_path, *TINY, stage(s), nproc=2)
    assert summary["resumed_from"]["step"] == MID
    losses = step_losses(ref)
    assert len(losses) == STEPS and losses[0] != losses[-1]  # it trained
    assert step_losses(tmp_path) == losses[MID:]
    want, got = load_file(str(ref / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    want, got = saved_tensors(checkpoint(ref, STEPS)), saved_tensors(checkpoint(tmp_path, STEPS))
    ranks_keys = {k.split(".")[1] for k in want if k.startswith("optim.")}
    assert ranks_keys == {"rank0", "rank1"} and any(k.endswith(".exp_avg") for k in want)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_export_of_a_deepspeed_checkpoint_is_the_runs_model(uninterrupted: dict[int, Path],
                                                           tmp_path: Path) -> None:
    """ZeRO 3 partitions every weight; the checkpoint still holds the whole model."""
    run, out = uninterrupted[3], tmp_path / "model.safetensors"
    proc = dtlab("export", str(checkpoint(run, STEPS)), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    want, got = load_file(str(run / "model.safetensors")), load_file(str(out))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def refusal(nproc: int, *overrides: str) -> str:
    proc = ranks.train(nproc, *overrides, "run.progress=false")
    lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("[rank ")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def test_a_checkpoint_of_another_layout_or_strategy_is_refused(uninterrupted: dict[int, Path],
                                                              tmp_path: Path) -> None:
    """deepspeed refuses another layout or strategy at set-up, before DeepSpeed starts: one line
    from rank 0, exit 2; ddp reading a deepspeed checkpoint: exit 2, without a traceback."""
    ckpt = checkpoint(uninterrupted[2], MID)
    auto = tmp_path / "auto"
    shutil.copytree(ckpt, checkpoint(auto, MID))
    assert refusal(2, *TINY, stage(3), f"run.dir={auto}") == (  # resume=auto
        f"dtlab: error: [rank 0] checkpoint '{checkpoint(auto, MID)}' holds DeepSpeed partitions "
        "for ZeRO stage 2 (this run: 3), which load only into the layout that wrote them; fix: "
        "resume with strategy.deepspeed.zero_stage=2, or start over with resume=none "
        "run.overwrite=true (deleting the earlier run in run.dir), or in another run.dir")
    run = (f"run.dir={tmp_path / 'run'}", f"resume={ckpt}")
    assert refusal(1, *TINY, stage(2), *run) == (
        f"dtlab: error: checkpoint '{ckpt}' holds DeepSpeed partitions for 2 ranks (this run: 1), "
        "which load only into the layout that wrote them; fix: resume with 2 ranks (e.g. "
        "--nproc-per-node 2), or start over with resume=none")
    ds_json = tmp_path / "zero3.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": 100}}))
    ckpt3 = checkpoint(uninterrupted[3], MID)
    assert refusal(1, *TINY, f"strategy.deepspeed.config={ds_json}", run[0], f"resume={ckpt3}") == (
        f"dtlab: error: checkpoint '{ckpt3}' holds DeepSpeed partitions for 2 ranks (this run: 1), "
        "zero_optimization.sub_group_size=1000000000 (this run: 100), which load only into the "
        "layout that wrote them; fix: resume with 2 ranks (e.g. --nproc-per-node 2) and "
        "zero_optimization.sub_group_size=1000000000 in the DeepSpeed JSON, or start over with "
        "resume=none")
    other = tmp_path / "ddp" / "step_000003"  # the manifest is all the refusal reads
    other.mkdir(parents=True)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    (other / MANIFEST).write_text(json.dumps({**manifest, "strategy": "ddp"}))
    assert refusal(1, *TINY, run[0], f"resume={other}") == (
        f"dtlab: error: checkpoint '{other}' was written by strategy ddp, and strategy deepspeed "
        "resumes only its own checkpoints (its optimizer state is DeepSpeed's per-rank "
        "partitions); fix: resume it with strategy.name=ddp, or start over with resume=none")
    # The other way round, the optimizer keys another strategy asks for are not there: exit 2 and
    # DCP's reason in a line per rank, never its tracebacks.
    proc = ranks.train(2, *TINY, "strategy.name=ddp", run[0], f"resume={ckpt}", "run.progress=false")
    lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("[rank ")]
    assert proc.returncode == 2 and lines and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(f"checkpoint '{ckpt}' cannot be loaded into this model: Missing key in checkpoint "
               "state_dict: optim." in x for x in lines), lines
