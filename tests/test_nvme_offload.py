"""ZeRO-Infinity: DeepSpeed ZeRO 3 with parameters and optimizer state offloaded to NVMe files.

A GPT of 9.7M parameters (large enough that DeepSpeed swaps its tensors: those under 1 MiB it
never does) trains at 1 and 2 ranks with the per-step losses of CPU offload, the swap files
it wrote measured per rank (summary.json's disk_bytes) equal to what `dtlab estimate` models, to
the byte, and removed at the end. What cannot work is refused in one line before any rank starts:
a machine without libaio (forced here), a swap directory that cannot be written, settings that
contradict NVMe offload. The tests that run DeepSpeed's async_io op (3 of them) need it built
for this venv: `make test-nvme` builds it (once, about 170 CPU-seconds: a fifth of what the rest
of the suite costs) and runs this file; `make test` and CI run them only where it is built
already, and say so in the skip reason otherwise (docs/benchmarks.md: the suite's time).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
from pathlib import Path

import pytest
import ranks
from conftest import dtlab, max_rel_dev, needs, step_losses, train

from dtlab.cli.compare import param_deviation

HAS_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = needs("deepspeed", "deepspeed")
GPT = ["model.name=gpt", "model.n_layer=3", "model.n_head=4", "model.n_embd=512",
       "model.block_size=32", "model.vocab_size=256", "train.global_batch_size=4",
       "train.max_steps=3", "train.optimizer=adamw", "train.lr=1e-3", "train.precision=bf16",
       "strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3",
       "strategy.deepspeed.offload_param=true", "strategy.deepspeed.offload_optimizer=true",
       "data.train_limit=64", "data.val_limit=8", "run.peak_tflops=1",  # short runs: 3 steps
       "run.save_model=true"]
NVME = [*GPT, "strategy.deepspeed.offload_device=nvme"]
LIBAIO = ("dtlab: error: offload to nvme needs DeepSpeed's async_io op, which cannot load: libaio "
          "(its headers and library) was not found; fix: install libaio (Debian/Ubuntu: apt-get "
          "install libaio-dev; RHEL: yum install libaio-devel; the first run then builds the op, "
          "about 1.5 min on 2 cores, cached), or offload to host memory instead "
          "(strategy.deepspeed.offload_device=cpu)")


@pytest.fixture(scope="module")
def aio() -> None:
    """DeepSpeed's async_io op, loaded (built first under `make test-nvme`), or the tests that
    need it skipped with the reason."""
    if not HAS_DS:
        pytest.skip("deepspeed not installed: pip install 'dtlab[deepspeed]'")
    from dtlab.config.strategies.deepspeed_aio import aio_problem, aio_status

    state = aio_status()[0]
    if state == "no-libaio":
        pytest.skip("libaio not installed: apt-get install libaio-dev, then make test-nvme")
    if state == "unbuilt" and not os.environ.get("DTLAB_TEST_NVME"):
        pytest.skip("DeepSpeed's async_io op is not built for this venv (about 170 CPU-seconds, "
                    "once): make test-nvme builds it and runs these")
    assert aio_problem() is None


def no_libaio(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This machine as one without libaio: DeepSpeed's libaio check fails, and no async_io op was
    built (an empty extensions cache)."""
    from dtlab.config.strategies import deepspeed_aio

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    builder = deepspeed_aio._aio_builder()
    monkeypatch.setattr(type(builder), "is_compatible", lambda self, verbose=False: False)


def modelled_disk(world: int, overrides: list[str]) -> list[int]:
    """Each rank's swap file bytes, as dtlab estimate models them."""
    from dtlab.config import load_config
    from dtlab.estimate.core import meta_model
    from dtlab.strategies.deepspeed_memory import modelled_state

    cfg = load_config(None, overrides)
    numels = [p.numel() for p in meta_model(cfg).parameters()]
    return [r["disk_bytes"] for r in modelled_state(numels, cfg, world)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_nvme_offload_trains_as_cpu_offload_does_and_writes_swap_files(
        aio: None, tmp_path: Path, nproc: int) -> None:
    """NVMe offload at 1 and 2 ranks trains a 9.7M-parameter GPT with the per-step losses of CPU
    offload, writes the modelled swap file bytes on every rank, and removes them at the end."""
    cpu = tmp_path / "cpu"
    nvme = tmp_path / "nvme"
    train(cpu, *GPT, nproc=nproc)
    summary = train(nvme, *NVME, nproc=nproc)
    ref = step_losses(cpu)
    assert len(ref) == 3 and ref[0] != ref[-1]
    assert max_rel_dev(step_losses(nvme), ref) < 1e-6
    # the weights written at the end are gathered from the swapped fp32 master partitions
    assert param_deviation(nvme / "model.safetensors", cpu / "model.safetensors") < 1e-6
    disk = summary["memory_per_rank"]["disk_bytes"]
    assert disk == modelled_disk(nproc, NVME) and min(disk) > 50e6  # swapped, to the byte
    zero = summary["strategy_options"]["deepspeed_config"]["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == str(nvme / "nvme")
    assert zero["stage3_prefetch_bucket_size"] == 0
    assert not (nvme / "nvme").exists()  # dtlab's own swap directory, removed at the end


@needs_ds
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_nvme_offload_without_libaio_is_refused_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: str) -> None:
    """Offload to nvme on a machine without libaio (DeepSpeed's check forced to fail) is refused
    in one line naming libaio and the fix, exit 2, before any rank starts: no run directory."""
    no_libaio(monkeypatch, tmp_path)
    run = tmp_path / "run"
    proc = dtlab("train", "--nproc-per-node", nproc, *NVME, f"run.dir={run}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [LIBAIO]
    assert not run.exists()


@pytest.mark.parametrize(("case", "overrides", "line"), [
    ("nvme with nothing offloaded",
     ["strategy.deepspeed.offload_param=false", "strategy.deepspeed.offload_optimizer=false"],
     "dtlab: error: strategy.deepspeed.offload_device=nvme but nothing is offloaded; fix: also "
     "set strategy.deepspeed.offload_param=true and/or offload_optimizer=true (with zero_stage=3)"),
    ("nvme below ZeRO stage 3",
     ["strategy.deepspeed.zero_stage=2", "strategy.deepspeed.offload_param=false"],
     "dtlab: error: zero_optimization.offload_optimizer.device=nvme needs ZeRO stage 3 (this "
     "run: stage 2); fix: strategy.deepspeed.zero_stage=3"),
    ("an nvme_path with cpu offload",
     ["strategy.deepspeed.offload_device=cpu", "strategy.deepspeed.nvme_path=/tmp/swap"],
     "dtlab: error: strategy.deepspeed.nvme_path=/tmp/swap but nothing is offloaded to nvme; "
     "fix: also set strategy.deepspeed.offload_device=nvme (with offload_param and/or "
     "offload_optimizer), or remove nvme_path"),
    ("nvme with checkpoints", ["train.checkpoint_every=2"],
     "dtlab: error: train.checkpoint_every=2 with NVMe offload: dtlab's DeepSpeed checkpoints do "
     "not cover the state NVMe offload keeps in its swap files (resuming one fails inside "
     "DeepSpeed); fix: train.checkpoint_every=0 (run.save_model=true still writes the trained "
     "weights), or strategy.deepspeed.offload_device=cpu"),
    ("nvme against the JSON's cpu device",
     ["strategy.deepspeed.config=configs/deepspeed/zero3_offload.json"],
     "dtlab: error: strategy.deepspeed.config 'configs/deepspeed/zero3_offload.json' sets "
     "zero_optimization.offload_optimizer.device=\"cpu\" but "
     "strategy.deepspeed.offload_device=nvme; fix: make them agree"),
])
def test_nvme_settings_that_cannot_work_are_refused_in_one_line(
        tmp_path: Path, case: str, overrides: list[str], line: str) -> None:
    """NVMe offload with nothing offloaded, below ZeRO stage 3, with checkpoints (which do not
    cover its swapped state), or against a JSON's offload device, and an nvme_path without it,
    are refused in one line, exit 2, with no run directory left."""
    run = tmp_path / "run"
    proc = dtlab("train", *NVME, *overrides, f"run.dir={run}")
    assert proc.returncode == 2, case
    assert proc.stderr.strip().splitlines() == [line]
    assert not run.exists()


@needs_ds
def test_an_nvme_path_that_is_a_file_or_refuses_direct_io_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An nvme_path that is a file, or on a file system that refuses O_DIRECT (forced), is
    refused in one line naming strategy.deepspeed.nvme_path and the fix; the file is intact."""
    from dtlab.config.strategies import deepspeed_aio

    blocker = tmp_path / "swap"
    blocker.write_text("keep me")
    run = tmp_path / "run"
    proc = dtlab("train", *NVME, f"strategy.deepspeed.nvme_path={blocker}", f"run.dir={run}")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"dtlab: error: strategy.deepspeed.nvme_path '{blocker}'") and "fix:" in line
    assert blocker.read_text() == "keep me" and not run.exists()

    real_open = os.open

    def no_direct_io(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(deepspeed_aio.os, "open", no_direct_io)
    proc = dtlab("train", *NVME, f"strategy.deepspeed.nvme_path={tmp_path / 'swap2'}",
                 f"run.dir={run}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dtlab: error: strategy.deepspeed.nvme_path '{tmp_path / 'swap2'}' is on a file system "
        "that refuses direct I/O (Invalid argument; tmpfs before Linux 6.6 does), which "
        "DeepSpeed's NVMe offload uses; fix: point it at a directory on a disk (ext4, xfs)"]
    assert not run.exists() and not (tmp_path / "swap2").exists()


def test_estimate_gives_disk_host_and_device_bytes_for_nvme(
        capsys: pytest.CaptureFixture[str]) -> None:
    """dtlab estimate answers for NVMe offload (it refused before): per rank the swap files'
    bytes (disk), the host's swap buffers and small tensors, and the device's share."""
    from dtlab.cli.main import main

    model = [o for o in NVME if o.startswith(("model.", "train.global", "train.opt", "train.prec"))]
    args = ["estimate", *model, "--world-size", "2", "--strategies", "deepspeed:3",
            "strategy.deepspeed.offload_param=true", "strategy.deepspeed.offload_optimizer=true"]
    assert main([*args, "strategy.deepspeed.offload_device=cpu", "--json"]) == 0
    cpu = json.loads(capsys.readouterr().out)["rows"][0]
    assert main([*args, "strategy.deepspeed.offload_device=nvme", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["exact"] and "disk" not in cpu
    # 6 MLP weights of 1,048,576 elements: bf16 partitions of 1 MiB swapped; their fp32 gradient
    # partitions (2 MiB); the fp32 master, exp_avg and exp_avg_sq of 4,867,584 elements per rank
    assert row["disk"] == 6 * 2**20 + 6 * 2 * 2**20 + 3 * 4 * 4_867_584 == 77_285_376
    # the host keeps what it does not swap plus 16 bf16 parameter buffers of 2e6 elements (in
    # whole KiB: 2,000,384) and 4 fp32 optimizer buffers of the sub group; the device keeps CPU
    # offload's share
    assert row["host"] == cpu["host"] - 77_285_376 + 16 * 2 * 2_000_384 + 4 * 4 * 4_867_584
    assert row["device_total"] == cpu["device_total"]
    assert main([*args, "strategy.deepspeed.offload_device=nvme"]) == 0
    out = capsys.readouterr().out
    assert " host  disk " in out and "disk = the swap files of NVMe offload" in out


@needs_ds
def test_doctor_reports_the_async_io_op_and_a_missing_libaio(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dtlab doctor reports NVMe offload's async_io op: found here, and a warning naming libaio
    and the fix when DeepSpeed's check is forced to fail (a warning: only NVMe offload needs it)."""
    from dtlab.doctor.system import nvme_offload

    here = nvme_offload()
    assert here.name == "nvme-offload" and here.status in ("ok", "warn")
    no_libaio(monkeypatch, tmp_path)
    check = nvme_offload()
    assert (check.status, check.found) == ("warn", "libaio (its headers and library) was not found")
    assert check.fix.startswith("install libaio (Debian/Ubuntu: apt-get install libaio-dev")


@needs_ds
def test_resuming_a_checkpoint_under_nvme_offload_is_refused(aio: None, tmp_path: Path) -> None:
    """Resuming a DeepSpeed checkpoint under NVMe offload (which its checkpoints do not cover) is
    refused in one line with the fix, exit 2, the checkpoint intact, no run directory left."""
    from dtlab.rundir.checkpoints import MANIFEST

    ckpt = tmp_path / "step_000002"
    ckpt.mkdir()
    (ckpt / MANIFEST).write_text(json.dumps({"strategy": "deepspeed", "step": 2}))
    run = tmp_path / "run"
    proc = ranks.train(1, *NVME, f"run.dir={run}", f"resume={ckpt}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dtlab: error: resuming a checkpoint under NVMe offload fails inside DeepSpeed (its "
        "swapped state is not restored); fix: resume it with "
        "strategy.deepspeed.offload_device=cpu, or start over with resume=none"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]  # no run.dir, no swap files
    assert json.loads((ckpt / MANIFEST).read_text())["step"] == 2
