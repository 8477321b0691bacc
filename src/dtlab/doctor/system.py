"""Software and hardware: python, torch build, backends, cores, memory, /dev/shm, GPUs, topology."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from dtlab.doctor.check import Check, fail, ok, skip, warn
from dtlab.files import meminfo

GiB = 1024**3
SHM_MIN = 1 * GiB  # below this, NCCL's shared-memory transport and DataLoader workers run short


def software() -> Iterator[Check]:
    yield ok("python", f"{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        yield fail("torch", f"import torch failed: {str(e).splitlines()[0][:200]}",
                   "torch is not installed in this environment, or its install is broken",
                   "make venv (installs the pinned torch), or pip install torch==<version>")
        return
    yield torch_build(torch)
    yield backends(torch)
    yield nvme_offload()


def nvme_offload() -> Check:
    """DeepSpeed's async_io op, which NVMe offload (ZeRO-Infinity) needs: not built here (the
    first NVMe run builds it), only looked for."""
    from dtlab.config.strategies.deepspeed_aio import FIX, aio_status

    state, found = aio_status()
    if state == "no-deepspeed":
        return skip("nvme-offload", f"{found} (only strategy deepspeed offloads to NVMe)")
    if state == "no-libaio":
        return warn("nvme-offload", found, "DeepSpeed's async_io op, which offload to nvme "
                    "needs, links against libaio (other strategies and offloads work)",
                    FIX.removeprefix("fix: "))
    return ok("nvme-offload", found, state=state)


def torch_build(torch) -> Check:  # noqa: ANN001 (the module)
    version = torch.__version__
    if torch.version.hip:
        build = f"ROCm {torch.version.hip} build"
    elif torch.version.cuda:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        build = f"CUDA {torch.version.cuda} build, cuDNN {cudnn_version(cudnn)}"
    else:
        build = "CPU build (no CUDA, no ROCm)"
    found = f"{version}, {build}"
    gpus_listed = nvidia_smi_gpus()
    if torch.version.cuda and not torch.cuda.is_available():
        return warn("torch", f"{found}; torch sees no GPU",
                    "no NVIDIA driver, CUDA_VISIBLE_DEVICES hides the GPUs, or the driver is older "
                    f"than CUDA {torch.version.cuda} needs",
                    "nvidia-smi must list the GPUs; update the driver or install a torch wheel "
                    "built for an older CUDA", build=build, version=version)
    if not (torch.version.cuda or torch.version.hip) and gpus_listed:
        return warn("torch", f"{found}, but nvidia-smi lists {gpus_listed} GPU(s)",
                    "a CPU-only torch wheel is installed on a GPU machine",
                    f"pip install torch=={version.split('+')[0]} from the CUDA wheel index "
                    "(https://download.pytorch.org/whl/cuXXX)", build=build, version=version)
    return ok("torch", found, build=build, version=version)


def cudnn_version(v: int | None) -> str:
    """cuDNN encodes 9.1.0 as 90100 but 8.9.2 as 8902."""
    if not v:
        return "not available"
    major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def backends(torch) -> Check:  # noqa: ANN001
    import torch.distributed as dist

    if not dist.is_available():
        return fail("backends", "torch.distributed is not available in this build",
                    "torch was built without distributed support (USE_DISTRIBUTED=0)",
                    "install an official torch wheel")
    names = ("gloo", "nccl", "mpi", "ucc", "xccl")
    have = {n: bool(getattr(dist, f"is_{n}_available", lambda: False)()) for n in names}
    nccl = ""
    if have["nccl"] and torch.cuda.is_available():
        nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
    found = ", ".join(f"{n} {nccl or 'yes'}" if n == "nccl" and have[n] else
                      f"{n} {'yes' if have[n] else 'no'}" for n in names)
    data = {"available": have, "nccl_version": nccl or None}
    if not have["gloo"]:
        return fail("backends", found, "this torch build has no gloo (dtlab's CPU backend)",
                    "install an official torch wheel (they all include gloo)", **data)
    if torch.cuda.is_available() and not torch.version.hip and not have["nccl"]:
        return fail("backends", found, "CUDA is available but this torch build has no NCCL",
                    "install an official CUDA torch wheel (Linux wheels include NCCL)", **data)
    return ok("backends", found, **data)


def hardware() -> Iterator[Check]:
    yield cpu()
    yield memory()
    yield shared_memory()
    yield gpus()
    yield topology()


def cpu() -> Check:
    from dtlab.distributed import cpus_available

    usable, total = cpus_available(), os.cpu_count() or 1
    found = f"{usable} of {total} cores available to this process"
    quota = cgroup_cpu_quota()
    if quota is not None and quota < usable:
        return warn("cpu", f"{found}; the cgroup CPU quota is {quota:g} CPUs",
                    "a container limits CPU time below the cores it can see, so dtlab's threads "
                    "per rank (cores / ranks) oversubscribe it",
                    f"set run.threads (or OMP_NUM_THREADS) to {max(1, int(quota))} / ranks per "
                    "node",
                    usable=usable, total=total, quota=quota)
    return ok("cpu", found, usable=usable, total=total, quota=quota)


def cgroup_cpu_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) / int(period)


def memory() -> Check:
    info = meminfo()
    if not info:
        return skip("memory", "/proc/meminfo not readable (not Linux)")
    total, avail = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    return ok("memory", f"{total / GiB:.1f} GiB RAM, {avail / GiB:.1f} GiB available",
              total_bytes=total, available_bytes=avail)


def shared_memory() -> Check:
    if not os.path.isdir("/dev/shm"):
        return skip("shm", "no /dev/shm (not Linux)")
    size = shutil.disk_usage("/dev/shm").total
    found = f"/dev/shm {size / GiB:.1f} GiB"
    if size < SHM_MIN:
        return warn("shm", found, "a container's default /dev/shm (64 MiB in Docker) is too small "
                    "for NCCL's shared-memory transport and DataLoader workers; they fail with bus "
                    "errors or 'unhandled system error'",
                    "docker run --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir "
                    "with medium: Memory at /dev/shm", bytes=size)
    return ok("shm", found, bytes=size)


def gpus() -> Check:
    import torch

    if not torch.cuda.is_available():
        return skip("gpus", "no CUDA device visible: CPU ranks with gloo")
    devices, busy = [], []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        devices.append({"index": i, "name": props.name,
                        "capability": f"{props.major}.{props.minor}",
                        "total_bytes": total, "free_bytes": free})
        if free < total / 2:
            busy.append(i)
    found = "; ".join(f"cuda:{d['index']} {d['name']} (sm_{d['capability'].replace('.', '')}) "
                      f"{d['free_bytes'] / GiB:.1f} of {d['total_bytes'] / GiB:.1f} GiB free"
                      for d in devices)
    if busy:
        return warn("gpus", found,
                    f"other processes hold more than half the memory of GPU(s) {busy}",
                    "nvidia-smi shows which processes; stop them or hide those GPUs with "
                    "CUDA_VISIBLE_DEVICES", devices=devices)
    return ok("gpus", found, devices=devices)


def nvidia_smi_gpus() -> int:
    """GPUs the driver lists (0 without nvidia-smi), independent of the torch build."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def parse_topology(text: str) -> dict[tuple[str, str], str]:
    """`nvidia-smi topo -m` -> {(GPUi, GPUj): link} for i < j (NV#, PIX, PXB, PHB, NODE, SYS).

    The header names the columns (GPU0 GPU1 ... NIC0 ... CPU Affinity); each GPU row starts with
    its name, then one link per column, "X" on the diagonal."""
    rows = [re.sub(r"\x1b\[[0-9;]*m", "", line).split() for line in text.splitlines()]
    header = next((r for r in rows if r and re.fullmatch(r"GPU\d+", r[0]) and "X" not in r), [])
    names = [t for t in header if re.fullmatch(r"GPU\d+", t)]
    links = {}
    for row in rows:
        if row and row[0] in names and "X" in row:
            i = names.index(row[0])
            for j, link in enumerate(row[1 : 1 + len(names)]):
                if j > i:
                    links[(names[i], names[j])] = link
    return links


def topology() -> Check:
    if not shutil.which("nvidia-smi"):
        return skip("topology", "no nvidia-smi on PATH: no GPU interconnect to inspect")
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        out = subprocess.CompletedProcess([], 1, "", str(e))
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[0][:200]
        return warn("topology", f"nvidia-smi topo -m failed: {first}",
                    "the NVIDIA driver is not loaded or does not match the kernel module",
                    "nvidia-smi must work before NCCL can; reinstall or reload the driver")
    return topology_from(out.stdout)


def topology_from(text: str) -> Check:
    links = parse_topology(text)
    if not links:
        return ok("topology", "fewer than 2 GPUs: no GPU-to-GPU links")
    kinds = Counter(links.values())
    found = f"{len(links)} GPU pairs: " + ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
    data = {"links": {f"{a}-{b}": link for (a, b), link in links.items()}}
    if set(kinds) == {"SYS"}:
        return warn("topology", found, "every GPU pair crosses the link between CPU sockets (SYS): "
                    "no NVLink and no shared PCIe switch, so intra-node collectives are slow",
                    "measure it (dtlab comm --op all_reduce); keep the most talkative groups "
                    "(tensor parallel) small, or use a node with NVLink", **data)
    return ok("topology", found, **data)
