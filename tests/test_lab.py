"""The lab switches (deliberate mistakes) do what they say, and sample usage is counted exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import max_rel_dev, step_losses, train

SMALL = ("data.synthetic.train_samples=512", "data.synthetic.val_samples=256", "train.epochs=1")


@pytest.mark.parametrize("mistake", [False, True])
def test_without_a_distributed_sampler_every_rank_repeats_the_same_samples(
        tmp_path: Path, mistake: bool) -> None:
    summary = train(tmp_path, "strategy.name=ddp", *SMALL, "run.track_samples=true",
                    f"lab.no_distributed_sampler={mistake}", nproc=2)
    usage = summary["sample_usage"]
    # 512 samples, global batch 64: 8 steps per epoch; without the sampler each rank walks the
    # whole set in micro batches of 32 (16 steps) and every sample is used once per rank.
    assert summary["steps"] == (16 if mistake else 8)
    assert usage == {"dataset_samples": 512, "samples_processed": 1024 if mistake else 512,
                     "unique_samples": 512, "min_uses_of_one_sample": 2 if mistake else 1,
                     "max_uses_of_one_sample": 2 if mistake else 1}
    own = summary["val_acc_own_samples_per_rank"]
    assert len(own) == 2 and sum(own) / 2 == pytest.approx(summary["val_acc"])  # 128 samples each


def test_mistakes_in_the_step_change_the_training(tmp_path: Path) -> None:
    """One process is deterministic: any difference from the reference is the switch's effect."""
    base = ("train.max_steps=6", "train.global_batch_size=64", "train.grad_accum_steps=2")
    train(tmp_path / "ref", *base)
    ref = step_losses(tmp_path / "ref")
    train(tmp_path / "no_zero_grad", *base, "lab.no_zero_grad=true")
    stale = step_losses(tmp_path / "no_zero_grad")
    assert stale[0] == ref[0] and max_rel_dev(stale, ref) > 1e-4  # old gradients pile up
    train(tmp_path / "no_loss_division", *base, "lab.no_loss_division=true")
    summed = step_losses(tmp_path / "no_loss_division")
    assert summed[0] == pytest.approx(2 * ref[0], rel=1e-6)  # the sum of 2 micro-batch means
    assert max_rel_dev([s / 2 for s in summed], ref) > 1e-4  # twice the gradient: another path
    train(tmp_path / "sync_every_micro_step", *base, "lab.sync_every_micro_step=true")
    assert step_losses(tmp_path / "sync_every_micro_step") == ref  # one process: nothing to sync
