"""Reading the launch environment: torchrun, SLURM srun, or none."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dtlab.distributed import DistEnv, detect_env, expand_hostlist, pick_backend, pick_device
from dtlab.errors import ConfigError
from dtlab.process.launch import report_failures


def test_no_launcher_means_one_process() -> None:
    assert detect_env({}) == DistEnv()
    # A lone process inside an allocation of several tasks, not started by srun: still one process.
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1


def test_torchrun_variables() -> None:
    env = detect_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"})
    assert env == DistEnv(3, 1, 4, 2, "10.0.0.1", 1234, "torchrun")
    assert env.nnodes == 2
    assert detect_env({"RANK": "0", "WORLD_SIZE": "1"}).launcher == "env"


def test_torchrun_inside_slurm_wins() -> None:
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0",
                      "SLURM_NTASKS": "8", "TORCHELASTIC_RUN_ID": "42"})
    assert env.launcher == "torchrun" and env.rank == 1 and env.world_size == 2
    # srun tasks whose script exported RANK/WORLD_SIZE from SLURM's variables
    mapped = detect_env({"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
    assert mapped.launcher == "slurm" and mapped.rank == 3


def test_slurm_srun_variables() -> None:
    env = detect_env({
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "123456",
    })
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.master_addr == "gpu007" and env.launcher == "slurm"
    assert env.master_port == 20000 + 123456 % 20000  # the same on every task, from the job id
    assert env.nnodes == 2


def test_slurm_step_values_and_explicit_master() -> None:
    env = detect_env({
        "SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", "MASTER_ADDR": "head",
        "MASTER_PORT": "4000",
    })
    assert (env.world_size, env.local_world_size, env.master_addr, env.master_port) == (
        2, 2, "head", 4000)


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[007-009,012],login1", ["gpu007", "gpu008", "gpu009", "gpu012", "login1"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("a,b[10-11]", ["a", "b10", "b11"]),
])
def test_expand_hostlist(nodelist: str, hosts: list[str]) -> None:
    assert expand_hostlist(nodelist) == hosts


def test_backend_follows_device() -> None:
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    assert pick_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert pick_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="run.backend=nccl needs CUDA"):
        pick_backend("nccl", torch.device("cpu"))


def test_launcher_names_the_failed_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # Rank 1 crashed (SIGABRT); the agent then stopped rank 0 with SIGTERM.
    assert report_failures({0: -15, 1: -6}) == 128 + 6
    err = capsys.readouterr().err
    assert "worker rank 1 failed with signal SIGABRT; ranks [0] were stopped" in err
    assert report_failures({0: 143, 1: 1}) == 1
    assert "worker rank 1 failed with exit code 1" in capsys.readouterr().err
    assert report_failures({0: 2, 1: 2}) == 2  # bad input: the worker already explained it
    assert report_failures({0: -9, 1: 2}) == 2  # rank 0 was SIGKILLed after ignoring SIGTERM
    assert capsys.readouterr().err == ""
    assert report_failures({0: -9, 1: -15}) == 128 + 9  # only signals: the SIGKILL is the cause
    assert "worker rank 0 failed with signal SIGKILL; ranks [1] were stopped" in capsys.readouterr().err


def test_one_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: pretend one is visible to check the rank -> GPU rule (the H100 run of
    # benchmarks/gpu_node.sh checked it for real).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    assert pick_device("auto", 0, "torchrun") == torch.device("cuda", 0)
    # srun --gpus-per-task=1: every task sees its own GPU as cuda:0
    assert pick_device("auto", 3, "slurm") == torch.device("cuda", 0)
    # torchrun --nproc-per-node 2 on a 1-GPU node: both ranks would share cuda:0
    with pytest.raises(ConfigError, match=r"local rank 1 has no GPU of its own \(1 visible\).*--nproc-per-node 1"):
        pick_device("auto", 1, "torchrun")
    assert pick_device("cpu", 1, "torchrun") == torch.device("cpu")


LEAVE = """
import atexit, sys
from dtlab.distributed import distributed, leave
atexit.register(lambda: print("teardown ran"))
if sys.argv[1] == "group":
    with distributed(device="cpu", need_group=True):
        pass
print("trained", flush=False)
leave(3)
"""


@pytest.mark.parametrize("group", ["group", "none"])
def test_leave_skips_teardown_only_after_a_destroyed_group(group: str) -> None:
    proc = subprocess.run([sys.executable, "-c", LEAVE, group], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "trained" in proc.stdout  # flushed before os._exit
    assert ("teardown ran" in proc.stdout) == (group == "none")
