"""dtlab's own cost per step: the loop overhead each run reports, DDP's non-finite check taken
from its all-reduce, and the stop vote that replaced a blocking all-reduce per step."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import ranks
import torch
import torch.distributed as dist
from conftest import train

from dtlab.models import SimpleCNN
from dtlab.run.loop_overhead import loop_overhead
from dtlab.strategies.ddp_hooks import BucketNorms

NAN = ("strategy.name=ddp", "run.fault.kind=nan", "run.fault.step=4", "run.fault.rank=1",
       "train.max_steps=8")


def test_ddp_stops_before_applying_a_non_finite_gradient(tmp_path: Path) -> None:
    """DDP, NaN loss on rank 1 at step 4: exit 1 with `non-finite gradient (norm nan) at step 4`, and only the checkpoint before it is kept."""
    proc = ranks.train(2, *NAN, "train.checkpoint_every=2", f"run.dir={tmp_path / 'a'}",
                       "run.progress=false")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "non-finite gradient (norm nan) at step 4" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_000002"]


def test_a_ddp_run_skips_a_non_finite_step_and_reports_its_loop_overhead(tmp_path: Path) -> None:
    """DDP with nan_policy=skip: one step skipped, a finite loss; summary.json's loop_overhead_s is positive, below the median loop time, and what loop_overhead() reads."""
    summary = train(tmp_path / "b", *NAN, "train.nan_policy=skip", "run.timing_warmup_steps=2",
                    nproc=2)
    assert summary["skipped_steps"] == 1 and summary["steps"] == 8
    assert math.isfinite(summary["final_train_loss"])
    overhead, loop = summary["loop_overhead_s"], summary["median_loop_time_s"]
    assert 0 < overhead < loop
    assert loop >= summary["step_time_s"]["p10"]  # the loop holds the step
    assert loop_overhead(tmp_path / "b") == overhead
    assert loop_overhead(tmp_path / "b" / "summary.json") == overhead
    assert loop_overhead({"loop_overhead_s": None}) is None


@pytest.fixture
def gloo_group() -> object:
    """A real one-rank gloo process group in this process (DDP needs one to hook into)."""
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_the_bucket_norm_equals_the_norm_of_the_gradients(gloo_group: object) -> None:
    """BucketNorms over several DDP buckets gives the gradients' global norm (1e-5: fp32 rounding), once per backward, and nan for a NaN gradient."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(SimpleCNN(channels=[8, 16], hidden=32),
                                                      bucket_cap_mb=0.01)
    norms = BucketNorms()
    model.register_comm_hook(None, norms.hook)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for i in range(2):  # the first backward in one bucket, the second in DDP's rebuilt ones
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert norms.buckets == 1 if i == 0 else (norms.buckets or 0) > 1
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        taken = norms.take()
        assert taken is not None and taken.item() == pytest.approx(expected.item(), rel=1e-5)
        assert norms.take() is None  # taken once
    model.zero_grad(set_to_none=True)
    (torch.nn.functional.cross_entropy(model(x), y) * float("nan")).backward()
    norm = norms.take()
    assert norm is not None and math.isnan(norm.item())
