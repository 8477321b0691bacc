"""Loop features: BatchNorm vs SyncBatchNorm, clipping on shards, FSDP options, precision,
GPT, learnability, and what a run writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import dtlab, max_rel_dev, step_losses, train

from dtlab.config import TrainConfig
from dtlab.levers.optim import build_optimizer, build_scheduler, peak_lr

TOL = 1e-5
SHORT = ("train.max_steps=12",)


@pytest.fixture(scope="module")
def reference(session_dir: Path) -> Path:
    run = session_dir / "features-single"
    train(run, *SHORT)
    return run


def test_batchnorm_needs_sync_for_parity(session_dir: Path) -> None:
    bn = ("model.batch_norm=true", *SHORT)
    single, local, synced, synced_fsdp = (session_dir / n for n in ("bn-single", "bn-ddp",
                                                                    "bn-sync", "bn-sync-fsdp"))
    train(single, *bn)
    train(local, "strategy.name=ddp", *bn, nproc=2)
    train(synced, "strategy.name=ddp", "strategy.sync_batchnorm=true", *bn, nproc=2)
    train(synced_fsdp, "strategy.name=fsdp", "strategy.sync_batchnorm=true", *bn, nproc=2)
    ref = step_losses(single)
    assert max_rel_dev(step_losses(local), ref) > 1e-4  # each rank normalises its own half
    assert max_rel_dev(step_losses(synced), ref) < TOL
    assert max_rel_dev(step_losses(synced_fsdp), ref) < TOL


def test_clipping_is_global_across_shards(reference: Path, session_dir: Path) -> None:
    clip = ("train.grad_clip=0.05", *SHORT)
    single = session_dir / "clip-single"
    train(single, *clip)
    ref = step_losses(single)
    assert max_rel_dev(ref, step_losses(reference)) > 1e-4  # clipping is active
    for strategy in ("fsdp", "fsdp1"):
        run = session_dir / f"clip-{strategy}"
        train(run, f"strategy.name={strategy}", *clip, nproc=2)
        assert max_rel_dev(step_losses(run), ref) < TOL, strategy


@pytest.mark.parametrize(("name", "overrides", "nproc"), [
    ("fsdp-offload", ["strategy.name=fsdp", "strategy.fsdp.cpu_offload=true"], 2),
    ("fsdp-keep", ["strategy.name=fsdp", "strategy.fsdp.reshard_after_forward=false"], 2),
    ("fsdp1-noshard", ["strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=NO_SHARD"], 2),
    ("fsdp1-size", ["strategy.name=fsdp1", "strategy.fsdp1.auto_wrap=size",
                    "strategy.fsdp1.min_num_params=1000"], 2),
    ("fsdp1-hybrid", ["strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=HYBRID_SHARD",
                      "strategy.fsdp1.shard_group_size=2"], 4),
    ("ddp-static", ["strategy.name=ddp", "strategy.ddp.static_graph=true",
                    "strategy.ddp.gradient_as_bucket_view=false"], 2),
])
def test_strategy_options_keep_parity(reference: Path, session_dir: Path, name: str,
                                      overrides: list[str], nproc: int) -> None:
    run = session_dir / name
    summary = train(run, *overrides, *SHORT, nproc=nproc)
    assert max_rel_dev(step_losses(run), step_losses(reference)) < TOL
    assert summary["world_size"] == nproc


def test_hybrid_shard_shards_within_groups(session_dir: Path) -> None:
    mem = json.loads((session_dir / "fsdp1-hybrid" / "summary.json").read_text())
    full = mem["n_params"] * 4
    # 4 ranks as 2 replicas x 2 shards: each rank holds about half the parameters.
    assert all(abs(b - full / 2) <= 0.02 * full for b in mem["memory_per_rank"]["param_bytes"])


def test_fsdp1_cpu_offload_is_refused_on_cpu(tmp_path: Path) -> None:
    proc = dtlab("train", "strategy.name=fsdp1", "strategy.fsdp1.cpu_offload=true",
                 f"run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "fix: on CPU use strategy.name=fsdp with strategy.fsdp.cpu_offload=true")


@pytest.mark.parametrize(("strategy", "precision"), [
    ("single", "bf16"), ("fsdp", "bf16"), ("fsdp1", "bf16"), ("single", "fp16"), ("fsdp", "fp16"),
])
def test_mixed_precision_trains(session_dir: Path, strategy: str, precision: str) -> None:
    tiny = ("model.channels=[4]", "model.hidden=16", "data.synthetic.image_size=16",
            "train.max_steps=4", "run.timing_warmup_steps=0")
    run = session_dir / f"{strategy}-{precision}"
    summary = train(run, f"strategy.name={strategy}", f"train.precision={precision}", *tiny,
                    nproc=1 if strategy == "single" else 2)
    losses = step_losses(run)
    assert summary["precision"] == precision and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(10)) < 0.1  # a fresh classifier over 10 classes


# A narrower CNN on smaller images: inductor's cold compile is most of this test, and fewer,
# smaller kernels compile faster (cold cache, 1 core: 34 s, 45 s with the quick CNN).
TINY = ("model.channels=[4]", "model.hidden=16", "data.synthetic.image_size=16", *SHORT)


def test_compile_keeps_the_losses(session_dir: Path) -> None:
    """DDP with the model compiled by inductor (its graphs split at the buckets, DDP's hooks in the
    compiled backward) keeps the eager losses. One rank: each rank compiles the same graphs, a
    second would compile them again (27 against 19 CPU-seconds with a cold cache)."""
    eager, run = session_dir / "tiny-eager", session_dir / "ddp-compiled"
    train(eager, *TINY)
    summary = train(run, "strategy.name=ddp", "train.compile=true", *TINY, nproc=1, timeout=400)
    assert summary["compile"] == "model"  # what true means
    assert max_rel_dev(step_losses(run), step_losses(eager)) < TOL


def test_run_writes_metrics_summary_and_config(reference: Path) -> None:
    summary = json.loads((reference / "summary.json").read_text())
    for key in ("strategy", "world_size", "backend", "device", "model", "n_params",
                "global_batch_size", "micro_batch_size", "steps", "median_step_time_s",
                "samples_per_s", "memory_per_rank", "final_train_loss", "val_loss", "val_acc",
                "torch_version", "wall_time_s", "threads_per_rank"):
        assert summary[key] is not None, key
    assert summary["steps"] == 12 and summary["timed_steps"] == 12 - 3
    assert summary["samples_seen"] == 12 * 64
    mem = summary["memory_per_rank"]
    assert {"setup_peak_rss_bytes", "warmup_peak_rss_bytes", "peak_rss_bytes"} <= set(mem)
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"lr", "step_time_s", "samples_per_s", "data_time_s"} <= set(steps[0])
    assert records[-1]["val_count"] == 1024  # every validation sample, once
    saved = (reference / "config.yaml").read_text()
    assert "max_steps: 12" in saved and f"dir: {reference}" in saved


def test_metric_lines_are_printed(tmp_path: Path) -> None:
    proc = dtlab("train", "train.max_steps=3", "run.log_every=1", f"run.dir={tmp_path}")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[METRIC] ")]
    assert proc.returncode == 0 and len(lines) == 3 + 1 + 1  # steps, evaluation, summary
    assert lines[0].startswith("[METRIC] step=1 epoch=0 loss=")
    assert "samples_per_s=" in lines[-1] and "strategy=single" in lines[-1]


def test_warmup_cosine_and_linear_scaling() -> None:
    cfg = TrainConfig(lr=0.1, warmup_steps=4, min_lr_ratio=0.1, global_batch_size=512,
                      lr_scale_base_batch=256)
    assert peak_lr(cfg) == pytest.approx(0.2)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg)
    sched = build_scheduler(opt, cfg, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert lrs[4] == pytest.approx(0.2) and lrs[-1] > 0.02 and lrs[-1] < 0.03
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak RSS reset")
def test_restart_peak_closes_one_peak_and_counts_the_next_from_now() -> None:
    from dtlab.instruments.metrics import peak_memory, restart_peak

    cpu, mib = torch.device("cpu"), 2**20
    big = torch.ones(256 * mib // 4)  # touched: resident
    del big
    before = restart_peak(cpu, "setup")["setup_peak_rss_bytes"]
    after = peak_memory(cpu)["peak_rss_bytes"]
    assert before - after > 200 * mib  # the freed 256 MiB belong to the set-up's peak only
    more = torch.ones(64 * mib // 4)
    assert peak_memory(cpu)["peak_rss_bytes"] - after > 60 * mib
    del more
