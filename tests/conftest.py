"""Shared helpers: run the real CLI in a subprocess and read what a run wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.compare import loss_deviation, read_run

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# The suite asserts CPU/gloo behaviour (2-4 ranks on one machine). On a GPU machine run.device=auto
# would pick CUDA, and 2 ranks on 1 GPU are refused: hide the GPUs from every test and its children.
# benchmarks/gpu_node.sh checks the CUDA/NCCL paths.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`dtlab ARGS` as a user runs it (python -m dtlab), capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "dtlab", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, cwd=cwd or ROOT,
    )


def train(run_dir: Path, *overrides: str, nproc: int = 1, config: str | None = None,
          timeout: float = 240) -> dict:
    """Run `dtlab train`, assert success, return its summary."""
    args = ["train", "--nproc-per-node", str(nproc)]
    args += ["--config", config] if config else []
    args += [*overrides, f"run.dir={run_dir}", "run.log_every=1", "run.progress=false"]
    proc = cli(*args, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def step_losses(run_dir: Path) -> list[float]:
    return read_run(run_dir)[1]


def max_rel_dev(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return loss_deviation(a, b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


LOCAL_SWEEP = """
base: {base}
overrides: {{train.max_steps: 12}}
matrix:
  strategy.name: [ddp, fsdp]
  nproc_per_node: [1, 2]
timeout_s: 180
"""


@pytest.fixture(scope="session")
def local_sweep(session_dir: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """2 strategies x {1, 2} ranks on the quick config, swept locally (shared by several tests)."""
    spec = session_dir / "sweep.yaml"
    spec.write_text(LOCAL_SWEEP.format(base=CONFIGS / "quick.yaml"))
    out = session_dir / "sweep"
    proc = cli("sweep", str(spec), "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


# make test runs the suite on 2 pytest-xdist workers with --dist loadgroup (2 cores: one worker
# runs while the other waits on a process start-up, a timeout or a SLURM job). Groups keep what
# must stay together on one worker: a module (its module-scoped fixtures run once), the tests
# sharing the local sweep, the tests that start the local SLURM cluster; each guide chapter is
# its own group, so chapters spread over both workers.
GROUPS = {"test_report_browser": "sweep", "test_sweep": "sweep", "test_slurm": "slurm"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__
        group = GROUPS.get(module, module)
        if module == "test_guide" and hasattr(item, "callspec"):
            chapter = item.callspec.params["chapter"]
            group = "slurm" if chapter.startswith("06") else f"guide-{chapter}"
        item.add_marker(pytest.mark.xdist_group(group))
