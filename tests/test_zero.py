"""ZeRO: `zero1` (DDP + torch's ZeroRedundancyOptimizer) and `deepspeed` (ZeRO stages 1, 2, 3).

Both train the same function as `single` (per-step losses and final parameters within 1e-5
relative, with gradient accumulation and active clipping), report the bytes each rank really
holds (zero1's uneven whole-tensor split; DeepSpeed's partitions), refuse what cannot work with
one line and exit 2, and run under torchrun and the deepspeed launcher. DeepSpeed tests are
skipped, with the reason shown, only where the `deepspeed` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import ranks
from conftest import (
    CONFIGS,
    ROOT,
    dtlab,
    fast_launches,
    free_port,
    max_rel_dev,
    needs,
    step_losses,
    train,
)

from dtlab.cli.compare import param_deviation, parse_spec
from dtlab.config import ConfigError, check_world, load_config
from dtlab.data import spec_for
from dtlab.models import build_model

HAS_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = needs("deepspeed", "deepspeed")
STEPS = 20
TOL = 1e-5
# Two micro batches per step and clipping that is active (the CNN's gradient norm is ~0.1-0.3).
COMMON = [f"train.max_steps={STEPS}", "train.grad_accum_steps=2", "train.grad_clip=0.1"]
DS_STAGES = ["deepspeed:1", "deepspeed:2", "deepspeed:3"]
SPECS = ["single", "zero1", *(DS_STAGES if HAS_DS else [])]


def label(spec: str) -> str:
    return spec.replace(":", "-")


def memory(run: Path) -> dict[str, list[int]]:
    return json.loads((run / "summary.json").read_text())["memory_per_rank"]


def assert_matches_single(run: Path, single: Path) -> None:
    ref = step_losses(single)
    assert len(ref) == STEPS and ref[0] != ref[-1]  # it trained
    assert max_rel_dev(step_losses(run), ref) < TOL
    assert param_deviation(run / "model.safetensors", single / "model.safetensors") < TOL


@pytest.fixture(scope="module")
def parity(session_dir: Path) -> Path:
    out = session_dir / "zero"
    with fast_launches():
        proc = dtlab("compare", "--strategies", ",".join(SPECS), "--nproc-per-node", "2",
                     "--verify", "--out", str(out), *COMMON)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"verify passed: {STEPS} steps vs single" in proc.stdout
    return out


@pytest.mark.parametrize("spec", ["zero1", *(pytest.param(s, marks=needs_ds) for s in DS_STAGES)])
def test_losses_and_parameters_match_single(parity: Path, spec: str) -> None:
    assert_matches_single(parity / label(spec), parity / "single")


def test_zero1_reports_the_uneven_split_it_makes(parity: Path) -> None:
    """ZeroRedundancyOptimizer gives whole tensors to ranks, largest first to the least loaded
    rank: the CNN's 2048x64 weight alone is 96% of the momentum. The bytes are exact."""
    cfg = load_config(None, [])
    sizes = sorted((p.numel() for p in build_model(cfg.model, spec_for(cfg)).parameters()), reverse=True)
    loads = [0, 0]
    for n in sizes:
        loads[loads.index(min(loads))] += n
    full = sum(sizes) * 4
    mem = memory(parity / "zero1")
    assert mem["param_bytes"] == [full, full] and mem["grad_bytes"] == [full, full]
    assert mem["optim_bytes"] == [4 * n for n in loads]  # SGD momentum of the owned tensors
    assert sum(mem["optim_bytes"]) == full and max(mem["optim_bytes"]) > 0.9 * full
    assert memory(parity / "single")["optim_bytes"] == [full]


@needs_ds
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_partitions_the_optimizer_state(parity: Path, stage: int) -> None:
    """Every stage splits the optimizer state (SGD momentum) and DeepSpeed's fp32 master copy in
    halves; ZeRO 3 also holds only its half of the parameters (plus the small ones it keeps)."""
    summary = json.loads((parity / f"deepspeed-{stage}" / "summary.json").read_text())
    full = summary["n_params"] * 4
    mem = summary["memory_per_rank"]
    for optim in mem["optim_bytes"]:  # momentum + master weights, each half of the model
        assert abs(optim - full) <= 64, (optim, full)
    for params, grads in zip(mem["param_bytes"], mem["grad_bytes"], strict=True):
        if stage == 3:  # half the model, plus the biases and conv weights kept whole
            assert full / 2 < params < 0.6 * full and abs(grads - full / 2) <= 32
        else:  # full parameters (DeepSpeed pads its flat buffer to an alignment)
            assert abs(params - full) <= 64
    assert summary["strategy_options"]["zero_stage"] == stage


def test_zero1_checkpoints_resume_and_load_into_ddp(session_dir: Path) -> None:
    """zero1 saves each rank's optimizer state under the parameter names (DDP's layout): a zero1
    resume on another world size, and a DDP resume, continue the same training."""
    a = session_dir / "zero1-ckpt"
    train(a, "strategy.name=zero1", "train.max_steps=12", "train.checkpoint_every=6", nproc=2)
    step6 = a / "checkpoints" / "step_000006"
    for name, nproc in (("zero1", 1), ("ddp", 1)):  # 1 rank (a process group of one)
        b = session_dir / f"zero1-ckpt-{name}-{nproc}"
        train(b, f"strategy.name={name}", "train.max_steps=12", f"resume={step6}", nproc=nproc)
        assert max_rel_dev(step_losses(b)[-6:], step_losses(a)[-6:]) < TOL


def test_zero1_with_a_ddp_comm_hook_matches_ddp_with_it(session_dir: Path) -> None:
    """A comm hook only changes DDP's gradient all-reduce; ZeRO-1 then steps on the same gradients
    (PowerSGD: stateful, low-rank, error feedback). local_sgd is refused (below)."""
    out = session_dir / "zero1-powersgd"
    with fast_launches():
        proc = dtlab("compare", "--strategies", "ddp,zero1", "--nproc-per-node", "2", "--out",
                     str(out), "train.max_steps=12", "strategy.ddp.comm_hook=powersgd",
                     "run.log_every=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert max_rel_dev(step_losses(out / "zero1"), step_losses(out / "ddp")) < 1e-6


def refusal(*args: str) -> str:
    proc = dtlab("train", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtlab: error: ") and "fix:" in lines[0]
    return lines[0]


def test_overlap_with_ddp_is_refused_on_gloo() -> None:
    line = refusal("--nproc-per-node", "2", "strategy.name=zero1", "strategy.zero1.overlap_with_ddp=true")
    assert "needs the NCCL backend" in line
    with pytest.raises(ConfigError, match="local_sgd does not combine"):
        check_world(load_config(None, ["strategy.name=zero1", "strategy.ddp.comm_hook=local_sgd"]), 2)


def test_missing_deepspeed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like
    proc = dtlab("train", "--nproc-per-node", "2", "strategy.name=deepspeed")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'dtlab[deepspeed]'" in proc.stderr


def test_deepspeed_config_contradictions_are_refused(tmp_path: Path) -> None:
    line = refusal("--nproc-per-node", "2", "strategy.name=deepspeed",
                   f"strategy.deepspeed.config={CONFIGS / 'deepspeed/zero2.json'}",
                   "strategy.deepspeed.zero_stage=3")
    assert "sets zero_optimization.stage=2 but strategy.deepspeed.zero_stage gives 3" in line

    def refused(ds: dict, *overrides: str) -> str:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        cfg = load_config(None, ["strategy.name=deepspeed", f"strategy.deepspeed.config={path}",
                                 "run.device=cpu", *overrides])
        with pytest.raises(ConfigError) as e:
            check_world(cfg, 2)
        return str(e.value)

    assert "train.global_batch_size gives 64" in refused({"train_batch_size": 32})
    assert "train.grad_accum_steps gives 2" in refused({"gradient_accumulation_steps": 4},
                                                       "train.grad_accum_steps=2")
    assert "bf16.enabled=true but train.precision=fp32" in refused({"bf16": {"enabled": True}})
    assert 'has a "optimizer" section' in refused({"optimizer": {"type": "Adam"}})
    assert "offload_param needs ZeRO stage 3" in refused({}, "strategy.deepspeed.offload_param=true")
    assert "refuses fp16" in refused({}, "train.precision=fp16")
    # Checkpoints and resume are DeepSpeed's too now (tests/test_deepspeed_checkpoint.py).
    check_world(load_config(None, ["strategy.name=deepspeed", "run.device=cpu",
                                   "train.checkpoint_every=5", "resume=none"]), 2)
    with pytest.raises(ConfigError, match="deepspeed:1, :2 or :3"):
        parse_spec("deepspeed:4")
    assert parse_spec("deepspeed:3") == ["strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3"]


def launched(cmd: list[str], run_dir: Path) -> subprocess.CompletedProcess[str]:
    args = [*COMMON, "strategy.name=deepspeed", f"run.dir={run_dir}", "run.log_every=1",
            "run.save_model=true", "run.progress=false"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@needs_ds
def test_the_offload_json_matches_single(parity: Path, session_dir: Path) -> None:
    """ZeRO 3 with optimizer and parameters offloaded (zero3_offload.json) on 2 ranks. (torchrun
    starts the run `dtlab train` starts: guide chapter 02; DeepSpeed under a launcher of its
    own: test_deepspeed_launcher below.)"""
    run = session_dir / "ds-offload"
    train(run, *COMMON, "strategy.name=deepspeed", "run.save_model=true",
          f"strategy.deepspeed.config={CONFIGS / 'deepspeed/zero3_offload.json'}", nproc=2)
    assert_matches_single(run, parity / "single")


@needs_ds
def test_deepspeed_launcher(parity: Path, session_dir: Path) -> None:
    """`deepspeed --num_gpus 2 --module dtlab.train` (it passes --local_rank; on CPU it starts one
    process unless told --num_gpus), ZeRO 2 from zero2.json with overlap_comm."""
    run = session_dir / "ds-launcher"
    launcher = Path(sys.executable).parent / "deepspeed"
    launched([str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
              "dtlab.train", f"strategy.deepspeed.config={CONFIGS / 'deepspeed/zero2.json'}"], run)
    assert_matches_single(run, parity / "single")
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


@needs_ds
def test_deepspeed_non_finite_gradient_stops_before_the_step(session_dir: Path) -> None:
    """dtlab's check sees DeepSpeed's global norm of the partitioned gradients (one rank here:
    the norm is the same code path, without a second process to start)."""
    proc = ranks.train(1, "strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3",
                       "train.max_steps=3", "run.fault.kind=nan", "run.fault.step=2",
                       f"run.dir={session_dir / 'ds-nan'}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "non-finite gradient (norm inf) at step 2" in proc.stderr
