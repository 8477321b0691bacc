"""`dtlab doctor`: passes on this machine, and reports forced problems with their fix and exit 1."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess

import pytest
from conftest import dtlab

from dtlab.doctor import Check
from dtlab.doctor.environment import checks as env_checks
from dtlab.doctor.environment import nccl_ifname_matches
from dtlab.doctor.network import master_endpoint
from dtlab.doctor.smoke import MARK, Mismatch, _expect, _report
from dtlab.doctor.system import cudnn_version, parse_topology, topology_from

# Launch variables of a surrounding job would change what the doctor checks; start from none.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`dtlab doctor ARGS` in this environment without launch variables, plus `env` (in this
    process: the doctor reads os.environ; its smoke test starts its ranks as processes)."""
    with pytest.MonkeyPatch.context() as mp:
        for key in LAUNCH_VARS:
            mp.delenv(key, raising=False)
        return dtlab("doctor", *args, env=env)


def line(stdout: str, name: str) -> str:
    """The table row of one check, with its cause/fix lines."""
    m = re.search(rf"^(ok|WARN|FAIL|skip)\s+{name}\s.*?(?=^(?:ok|WARN|FAIL|skip)\s|^\d+ checks:)",
                  stdout, re.M | re.S)
    assert m, f"no check {name} in:\n{stdout}"
    return m.group(0)


def test_doctor_passes_here_with_gloo_and_a_real_collective() -> None:
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert line(proc.stdout, "backends").startswith("ok") and "gloo yes" in proc.stdout
    smoke = line(proc.stdout, "smoke_gloo")
    # 2 ranks: all_reduce of (1 + 2), all_gather of the ranks, a timed 1 MiB all-reduce
    assert smoke.startswith("ok") and "all_reduce 3 (expected 3)" in smoke, smoke
    assert "all_gather [0, 1]" in smoke and re.search(r"[\d.]+ ms median", smoke), smoke
    assert "-> exit 0" in proc.stdout and "Traceback" not in proc.stderr


def test_json_has_every_check_and_the_smoke_numbers() -> None:
    proc = doctor("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["exit_code"] == 0 and report["counts"]["fail"] == 0
    for name in ("python", "torch", "backends", "cpu", "memory", "env", "hostname", "loopback",
                 "free_port", "smoke_gloo", "smoke_nccl"):
        assert set(by_name[name]) == {"name", "status", "found", "cause", "fix", "data"}, name
    assert by_name["backends"]["data"]["available"]["gloo"] is True
    ranks = by_name["smoke_gloo"]["data"]["ranks"]
    assert [r["all_reduce"] for r in ranks] == [3.0, 3.0]
    assert [r["all_gather"] for r in ranks] == [[0, 1], [0, 1]]
    assert all(r["ms"] > 0 and r["busbw_gbps"] > 0 for r in ranks)
    assert by_name["cpu"]["data"]["usable"] == len(os.sched_getaffinity(0))


def test_unresolvable_master_addr_fails_with_its_fix() -> None:
    proc = doctor("--no-smoke", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29500")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = line(proc.stdout, "master")
    assert row.startswith("FAIL") and "no-such-host.invalid does not resolve" in row, row
    assert "fix:   set MASTER_ADDR to the rank-0 node's IP" in row, row
    assert "Traceback" not in proc.stderr


def test_occupied_master_port_fails_with_a_free_port_as_fix() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = doctor("--no-smoke", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = line(proc.stdout, "master")
    assert row.startswith("FAIL") and f"port {port} is already in use" in row, row
    suggested = int(re.search(r"export MASTER_PORT=(\d+)", row).group(1))
    with socket.socket() as s:  # the port it suggests is free (as far as a moment later tells)
        s.bind(("0.0.0.0", suggested))


def test_thread_oversubscription_is_a_warning_not_a_failure() -> None:
    cores = len(os.sched_getaffinity(0))
    proc = doctor("--no-smoke", "--nproc-per-node", "2", OMP_NUM_THREADS=str(cores))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = line(proc.stdout, "threads")
    assert row.startswith("WARN") and f"= {2 * cores} threads on {cores} cores" in row, row
    assert f"fix:   OMP_NUM_THREADS={max(1, cores // 2)}" in row


def test_smoke_ranks_past_the_timeout_are_killed_and_the_check_fails() -> None:
    # 0.2 s is shorter than importing torch, so the deadline always strikes first.
    proc = doctor("--json", "--timeout", "0.2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    smoke = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}["smoke_gloo"]
    assert smoke["status"] == "fail" and smoke["data"]["killed"] == [0, 1], smoke
    assert "not finished after 0.2 s" in smoke["found"] and "--timeout" in smoke["fix"]
    for pid in smoke["data"]["pids"]:  # no rank outlives the check
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_other(pid), pid


def _zombie_or_other(pid: int) -> bool:
    """A recycled pid belongs to another program; ours would still be `python -m dtlab...`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return True
    return b"dtlab.doctor.smoke" not in cmd


def test_a_bad_interface_name_fails_the_check_and_the_real_collective() -> None:
    proc = doctor(GLOO_SOCKET_IFNAME="nosuchif0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert line(proc.stdout, "GLOO_SOCKET_IFNAME").startswith("FAIL")
    smoke = line(proc.stdout, "smoke_gloo")  # gloo itself refuses: the doctor shows its message
    assert smoke.startswith("FAIL") and "nosuchif0" in smoke, smoke


def test_master_endpoint_roles() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    host = master_endpoint({"MASTER_ADDR": "localhost", "MASTER_PORT": str(free)})
    assert host.status == "ok" and host.data["role"] == "host", host  # rank 0 would bind it
    with socket.socket() as listening:  # another rank: the port must answer, not be free
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = str(listening.getsockname()[1])
        client = master_endpoint({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "1"})
    assert client.status == "ok" and client.data["role"] == "client", client
    early = master_endpoint({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free), "RANK": "1"})
    assert early.status == "warn" and "nothing listens" in early.found, early
    assert master_endpoint({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}).status == "fail"


def test_rank_results_wrong_values_and_crashes() -> None:
    try:
        _expect("all_reduce", [2.0, 3.0], [3.0, 3.0])
        raise AssertionError("a wrong value passed")
    except Mismatch as e:
        assert str(e) == "all_reduce gave [2.0, 3.0], expected [3.0, 3.0]"
    _expect("broadcast", [0.0, 1.0], [0.0, 1.0])
    assert _report(f"noise\n{MARK}{json.dumps({'rank': 1, 'ms': 0.5})}\n", 0) == {
        "rank": 1, "ms": 0.5}
    crashed = _report("loading\nSegmentation fault (core dumped)\n", -11)  # no result line
    assert crashed["error"] == ("exited with code -11 without a result "
                                "(Segmentation fault (core dumped))")


def names(found: list[Check]) -> dict[str, str]:
    return {c.name: c.status for c in found}


def test_environment_rules() -> None:
    ifs = ["lo", "eth0", "ib0"]

    def run(env: dict[str, str], nproc: int = 2, gpus: int = 0) -> dict[str, str]:
        return names(env_checks(env, nproc, cores=8, gpus=gpus, interfaces=ifs))

    assert run({}) == {"env": "ok"}
    assert run({"RANK": "0"})["ranks"] == "warn"  # without WORLD_SIZE
    assert run({"RANK": "2", "WORLD_SIZE": "2"})["ranks"] == "fail"
    assert run({"RANK": "x", "WORLD_SIZE": "2"}) == {"env": "ok", "RANK": "fail"}
    assert run({"MASTER_ADDR": "h"})["master_vars"] == "warn"
    assert "threads" not in run({"OMP_NUM_THREADS": "4"})  # 4 x 2 ranks = 8 cores
    assert run({"OMP_NUM_THREADS": "4"}, nproc=3)["threads"] == "warn"
    assert run({"OMP_NUM_THREADS": "0"})["OMP_NUM_THREADS"] == "fail"
    assert run({"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "0"}) == {
        "env": "ok", "NCCL_P2P_DISABLE": "warn"}
    assert run({"NCCL_ASYNC_ERROR_HANDLING": "1"})["NCCL_ASYNC_ERROR_HANDLING"] == "warn"
    assert run({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})["TORCH_DISTRIBUTED_DEBUG"] == "warn"
    assert "GLOO_SOCKET_IFNAME" not in run({"GLOO_SOCKET_IFNAME": "eth0,lo"})
    assert run({"GLOO_SOCKET_IFNAME": "eth1"})["GLOO_SOCKET_IFNAME"] == "fail"
    assert run({"NCCL_SOCKET_IFNAME": "^lo,eth,ib"})["NCCL_SOCKET_IFNAME"] == "fail"
    assert run({"CUDA_VISIBLE_DEVICES": ""})["CUDA_VISIBLE_DEVICES"] == "warn"
    assert run({"CUDA_VISIBLE_DEVICES": "0,1,0"})["CUDA_VISIBLE_DEVICES"] == "fail"
    assert run({}, nproc=4, gpus=2)["gpus_per_rank"] == "warn"


def test_nccl_socket_ifname_syntax() -> None:
    ifs = ["lo", "eth0", "eth1", "ib0", "docker0"]
    assert nccl_ifname_matches("eth", ifs) == ["eth0", "eth1"]  # prefixes
    assert nccl_ifname_matches("=eth", ifs) == []  # exact names
    assert nccl_ifname_matches("=eth1,ib0", ifs) == ["eth1", "ib0"]
    assert nccl_ifname_matches("^lo,docker", ifs) == ["eth0", "eth1", "ib0"]  # exclusions


# A 4-GPU `nvidia-smi topo -m` in its usual layout: two NVLink pairs on two sockets, a NIC.
TOPO = "\t".join(["", "GPU0", "GPU1", "GPU2", "GPU3", "NIC0", "CPU Affinity", "NUMA Affinity",
                  "GPU NUMA ID"]) + """
GPU0\t X \tNV12\tSYS\tSYS\tPXB\t0-31\t0\t\tN/A
GPU1\tNV12\t X \tSYS\tSYS\tPXB\t0-31\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNV12\tSYS\t32-63\t1\t\tN/A
GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
"""


def test_topology_parsing_and_the_sys_only_warning() -> None:
    links = parse_topology(TOPO)
    assert links == {("GPU0", "GPU1"): "NV12", ("GPU0", "GPU2"): "SYS", ("GPU0", "GPU3"): "SYS",
                     ("GPU1", "GPU2"): "SYS", ("GPU1", "GPU3"): "SYS", ("GPU2", "GPU3"): "NV12"}
    check = topology_from(TOPO)
    assert check.status == "ok" and check.found == "6 GPU pairs: 2 x NV12, 4 x SYS"
    sys_only = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSYS\t0-7\nGPU1\tSYS\t X \t8-15\n"
    assert topology_from(sys_only).status == "warn"
    one_gpu = "\tGPU0\tCPU Affinity\nGPU0\t X \t0-7\n"
    assert topology_from(one_gpu).status == "ok" and not parse_topology(one_gpu)


def test_cudnn_version_encodings() -> None:
    assert (cudnn_version(90100), cudnn_version(8902), cudnn_version(None)) == (
        "9.1.0", "8.9.2", "not available")


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    proc = doctor("--timeout", "0")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "dtlab: error: argument --timeout: '0' must be above 0; fix: e.g. --timeout 60"], proc.stderr
