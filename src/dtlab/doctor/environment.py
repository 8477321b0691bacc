"""The launch environment variables that are set, and the values known to break or slow a run.

Pure functions of the environment mapping (plus cores, GPUs and interface names, passed in), so
each rule can be tested without touching the process environment.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from dtlab.doctor.check import Check, fail, ok, warn

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
         "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
         "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_JOB_NODELIST",
         "SLURM_NTASKS_PER_NODE")
PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_CPP_LOG", "GLOO_")
INTEGERS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT",
            "OMP_NUM_THREADS")

# NCCL variables that switch a fast transport off: fine to debug a hang, costly if forgotten.
SLOWING = {
    "NCCL_P2P_DISABLE": "direct GPU-to-GPU copies (NVLink/PCIe) are off; traffic goes through host "
                        "memory",
    "NCCL_SHM_DISABLE": "the shared-memory transport is off; intra-node traffic falls back to "
                        "sockets",
    "NCCL_IB_DISABLE": "InfiniBand/RoCE is off; inter-node traffic falls back to TCP sockets",
}
RENAMED = {"NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
           "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
           "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG"}


def relevant(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k in NAMES or k.startswith(PREFIXES)}


def checks(env: Mapping[str, str], nproc: int, cores: int | None = None, gpus: int | None = None,
           interfaces: list[str] | None = None) -> list[Check]:
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if gpus is None:
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:  # reported by the torch check
            gpus = 0
    if interfaces is None:
        interfaces = [name for _, name in socket.if_nameindex()]
    found = relevant(env)
    listing = " ".join(f"{k}={v}" for k, v in found.items()) or (
        "no launch variable set (RANK, MASTER_*, NCCL_*, GLOO_*, OMP_NUM_THREADS, SLURM_*...): "
        "a plain shell")
    result = [ok("env", listing, variables=found)]
    result += integers(env)
    bad = {c.data.get("variable") for c in result}
    result += ranks(env, bad)
    result += threads(env, nproc, cores, bad)
    result += nccl(env)
    result += socket_interfaces(env, interfaces)
    result += visible_devices(env, nproc, gpus)
    return result


def integers(env: Mapping[str, str]) -> list[Check]:
    out = []
    for name in INTEGERS:
        value = env.get(name)
        positive = name == "OMP_NUM_THREADS"  # 0 threads is no setting at all
        if value is not None and not (value.strip().isdigit() and int(value) >= positive):
            kind = "positive integer" if positive else "non-negative integer"
            out.append(fail(name, f"{name}={value!r} is not a {kind}",
                            "a typo or an unexpanded shell variable in the job script",
                            f"export {name}=<integer>, or unset {name}", variable=name))
    return out


def ranks(env: Mapping[str, str], bad: set) -> list[Check]:
    out = []
    rank, world = env.get("RANK"), env.get("WORLD_SIZE")
    if (rank is None) != (world is None):
        have, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        out.append(warn("ranks", f"{have} is set but {missing} is not",
                        f"env:// initialisation needs both; dtlab ignores a lone {have} and runs "
                        "one process",
                        f"set both (torchrun and srun do it for you) or unset {have}"))
    for index, size, cause in (
            ("RANK", "WORLD_SIZE", "ranks count from 0 to WORLD_SIZE-1; a hand-written launch "
             "script is off by one or reuses another job's values"),
            ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "local ranks count from 0 to LOCAL_WORLD_SIZE-1 on "
             "every node")):
        i, n = env.get(index), env.get(size)
        if i is not None and n is not None and not {index, size} & bad and int(i) >= int(n):
            out.append(fail("ranks", f"{index}={i} but {size}={n}", cause,
                            "let torchrun or srun set them"))
    for name, other in (("MASTER_ADDR", "MASTER_PORT"), ("MASTER_PORT", "MASTER_ADDR")):
        if name in env and other not in env and "SLURM_JOB_ID" not in env:
            out.append(warn("master_vars", f"{name} is set but {other} is not",
                            "env:// initialisation (RANK/WORLD_SIZE launches) needs both",
                            f"export {other} as well (every rank the same), or unset {name}"))
    return out


def threads(env: Mapping[str, str], nproc: int, cores: int, bad: set) -> list[Check]:
    value = env.get("OMP_NUM_THREADS")
    if value is None or "OMP_NUM_THREADS" in bad or int(value) * nproc <= cores:
        return []
    per_rank = max(1, cores // nproc)
    return [warn("threads", f"OMP_NUM_THREADS={value} x {nproc} ranks per node = "
                 f"{int(value) * nproc} threads on {cores} cores",
                 "oversubscription: the ranks' compute threads take turns on the cores, and every "
                 "collective waits for the slowest rank (dtlab's own runs set run.threads instead)",
                 f"OMP_NUM_THREADS={per_rank} (cores / ranks per node), or unset it",
                 threads=int(value), ranks=nproc, cores=cores)]


def nccl(env: Mapping[str, str]) -> list[Check]:
    out = []
    for name, effect in SLOWING.items():
        if env.get(name, "0").strip() not in ("", "0"):
            out.append(warn(name, f"{name}={env[name]}: {effect}",
                            "left over from debugging a hang, or copied from another cluster's "
                            "script",
                            f"unset {name} unless this machine needs it; measure with dtlab comm"))
    for old, new in RENAMED.items():
        if old in env:
            out.append(warn(old, f"{old} is set; PyTorch reads {new}",
                            "the variable was renamed; the old name is deprecated",
                            f"export {new}={env[old]} and unset {old}"))
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip() == "0":
        out.append(warn("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING=0",
                        "a failed or timed-out NCCL collective is not acted on: the job hangs "
                        "instead of stopping", "unset it (PyTorch's default tears the job down)"))
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        out.append(warn("TORCH_DISTRIBUTED_DEBUG", "TORCH_DISTRIBUTED_DEBUG=DETAIL",
                        "every collective is checked for consistency across ranks first: slow",
                        "use it to find a mismatched collective, then unset it (or use INFO)"))
    return out


def nccl_ifname_matches(spec: str, interfaces: list[str]) -> list[str]:
    """NCCL_SOCKET_IFNAME: comma-separated prefixes; leading ^ excludes them, leading = is exact."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [s for s in spec.lstrip("=").split(",") if s]

    def hit(name: str) -> bool:
        return any(name == s if exact else name.startswith(s) for s in items)

    return [n for n in interfaces if hit(n) != exclude]


def socket_interfaces(env: Mapping[str, str], interfaces: list[str]) -> list[Check]:
    out = []
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo is not None:
        missing = [n for n in gloo.split(",") if n not in interfaces]
        if missing or not gloo:
            have = ", ".join(interfaces)
            out.append(fail("GLOO_SOCKET_IFNAME", f"GLOO_SOCKET_IFNAME={gloo}: no interface named "
                            f"{','.join(missing) or repr(gloo)} here (have: {have})",
                            "gloo cannot create its device, so every gloo process group fails",
                            "set it to an interface that `ip -br addr` lists (e.g. eth0; lo for "
                            "one node), or unset it", variable="GLOO_SOCKET_IFNAME"))
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec is not None and not nccl_ifname_matches(spec, interfaces):
        out.append(fail("NCCL_SOCKET_IFNAME", f"NCCL_SOCKET_IFNAME={spec} matches none of "
                        f"{', '.join(interfaces)}",
                        "NCCL finds no socket interface and fails to initialise",
                        "set it to a prefix of an interface `ip -br addr` lists, or unset it",
                        variable="NCCL_SOCKET_IFNAME"))
    return out


def visible_devices(env: Mapping[str, str], nproc: int, gpus: int) -> list[Check]:
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None and value.strip() in ("", "-1", "NoDevFiles"):
        return [warn("CUDA_VISIBLE_DEVICES", f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU",
                     "set on purpose for CPU runs, or a scheduler gave this job no GPU",
                     "unset it (or list the GPU indices) to train on GPUs; ignore for CPU runs")]
    if value is not None and len(set(value.split(","))) < len(value.split(",")):
        return [fail("CUDA_VISIBLE_DEVICES", f"CUDA_VISIBLE_DEVICES={value} repeats a GPU",
                     "two ranks would share one GPU; NCCL refuses ('Duplicate GPU detected')",
                     "list each GPU once")]
    if 0 < gpus < nproc:
        return [warn("gpus_per_rank", f"{nproc} ranks per node but {gpus} GPU(s) visible",
                     "dtlab and NCCL need one GPU per rank", f"--nproc-per-node {gpus}, or make "
                     "more GPUs visible (CUDA_VISIBLE_DEVICES, the scheduler's --gpus)")]
    return []
