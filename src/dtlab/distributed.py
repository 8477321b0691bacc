"""Distributed set-up in one place: who am I (env), which device and backend, the process group.

Three launch environments are understood:
- torchrun / torch elastic: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT;
- SLURM `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of the node list;
- nothing: one process, world size 1.
The device (cuda:LOCAL_RANK or cpu) and the backend (nccl on CUDA, gloo on CPU) are chosen here
and nowhere else. `distributed()` destroys the process group on every exit path.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from dtlab.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "none"  # torchrun | slurm | env (RANK etc. set by hand) | none

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as `gpu[01-03,07],login1` (what `scontrol show hostnames` does)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            if nodelist[start:i]:
                items.append(nodelist[start:i])
            start = i + 1
    hosts: list[str] = []
    for item in items:
        m = re.search(r"\[([^\]]+)\]", item)
        if not m:
            hosts.append(item)
            continue
        head, tail = item[: m.start()], item[m.end() :]
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts += expand_hostlist(f"{head}{n:0{len(lo)}d}{tail}")
    return hosts


def _tasks_per_node(value: str | None) -> int | None:
    """SLURM writes tasks per node as `4(x2),3`; the first count is this layout's per-node size."""
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else None


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            # LOCAL_SIZE: the deepspeed launcher's name for it.
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", env["WORLD_SIZE"]))),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
            # torch elastic marks its workers; srun tasks that export RANK keep SLURM's variables.
            launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env
            else "slurm" if "SLURM_PROCID" in env else "env",
        )
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if "SLURM_PROCID" in env and ntasks and int(ntasks) > 1:
        world = int(ntasks)
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")) or _tasks_per_node(
            env.get("SLURM_NTASKS_PER_NODE")
        )
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        # Every task must agree on the port without talking: derive it from the job id.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world,
            local_world_size=per_node or max(1, world // nnodes),
            master_addr=env.get("MASTER_ADDR") or expand_hostlist(nodes)[0],
            master_port=int(port),
            launcher="slurm",
        )
    return DistEnv()


def pick_device(preference: str, local_rank: int, launcher: str = "none") -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device=cuda but no CUDA device is visible; fix: run.device=cpu")
        visible = torch.cuda.device_count()
        # One visible GPU per task (SLURM's --gpus-per-task binding): it is this rank's. Under
        # torchrun all local ranks see the same GPUs, so two ranks on one GPU is a mistake (NCCL
        # refuses it: "Duplicate GPU detected").
        index = 0 if visible == 1 and launcher == "slurm" else local_rank
        if index >= visible:
            raise ConfigError(
                f"local rank {local_rank} has no GPU of its own ({visible} visible); fix: start "
                f"at most {visible} process(es) per node (--nproc-per-node {visible}), or "
                "run.device=cpu to run more ranks on the CPU with gloo"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def pick_backend(preference: str, device: torch.device) -> str:
    if preference == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if preference == "nccl" and device.type != "cuda":
        raise ConfigError("run.backend=nccl needs CUDA devices; fix: run.backend=gloo or auto")
    return preference


def cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class DistContext:
    env: DistEnv
    device: torch.device
    backend: str | None  # None: no process group (one process, strategy `single`)
    threads: int

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def synchronize(self) -> None:
        """Wait for queued device work, so that wall-clock readings are honest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.backend is not None:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend is not None and self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def agree_stop(self, signum: int) -> int:
        """The largest stop signal any rank has received (0: none), so that all ranks stop after
        the same step: one all-reduce of one int (measured: docs/reliability.md#signals)."""
        if self.backend is None or self.world_size == 1:
            return signum
        flag = torch.tensor([signum], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's list of numbers, indexed by rank (one all-gather)."""
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.backend is None or self.world_size == 1:
            return [local.tolist()]
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return [t.tolist() for t in out]


COMM_FAILURE = ("gloo", "nccl", "timed out", "timeout", "connection", "pair closure", "peer")


def is_comm_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(k in text for k in COMM_FAILURE)


def who_stopped(ctx: DistContext, step: int, error: BaseException, grace_s: float = 3.0) -> str:
    """After a collective failed here: which ranks never reached it?

    Every rank whose collective failed leaves a mark in the rendezvous store; after a grace period
    the ranks without a mark are the ones that stopped taking part (hung, crashed or killed)."""
    first = str(error).strip().splitlines()[0]  # as a comm hook's callback wraps it: the cause
    first = re.sub(r"^Got the following error when running the callback: \w+: ", "", first)
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:200]  # no source path
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"dtlab/failed/{ctx.rank}", str(step))
        time.sleep(grace_s)
        silent = [r for r in range(ctx.world_size) if not store.check([f"dtlab/failed/{r}"])]
    except Exception:  # the store itself may be gone with the failed rank  # noqa: BLE001
        silent = []
    who = f"rank(s) {silent} stopped taking part" if silent else "the peers could not be asked"
    return (f"a collective failed at step {step} on rank {ctx.rank} ({first}); {who}; "
            "see their output above. fix: look for the cause there (a crash, OOM, a hang in "
            "data loading), or raise run.timeout_s if the step is legitimately slow")


def _raise_on_sigterm(signum: int, frame: object) -> None:
    # The launcher stops surviving workers with SIGTERM; exiting through Python runs the cleanup.
    sys.exit(128 + signum)


_group_destroyed = False  # set by distributed(), read by leave()


@contextmanager
def distributed(
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = 300.0,
    threads: int = 0,
    need_group: bool = False,
    env: DistEnv | None = None,
    destroy: bool = True,
) -> Iterator[DistContext]:
    """Initialise the process group (when several ranks, or `need_group`) and always destroy it
    (`destroy=False` only for lab.no_destroy_process_group, to measure what skipping it costs)."""
    global _group_destroyed
    env = env or detect_env()
    dev = pick_device(device, env.local_rank, env.launcher)
    n_threads = threads or max(1, cpus_available() // env.local_world_size)
    torch.set_num_threads(n_threads)
    group_backend = pick_backend(backend, dev) if env.world_size > 1 or need_group else None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        if group_backend is not None:
            timeout = datetime.timedelta(seconds=timeout_s)
            if env.launcher == "none":  # a group of one (rank 0 of 1), for wrappers that insist
                store = dist.HashStore()
            else:
                # Export the variables for env:// (and for libraries that read them).
                exported = {"MASTER_ADDR": env.master_addr, "MASTER_PORT": env.master_port,
                            "RANK": env.rank, "WORLD_SIZE": env.world_size,
                            "LOCAL_RANK": env.local_rank, "LOCAL_WORLD_SIZE": env.local_world_size}
                os.environ.update({k: str(v) for k, v in exported.items() if v is not None})
                store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
                # After a restart, keys of the previous attempt (peer addresses of dead processes)
                # must not be read: gloo then tries a dead port until the timeout ("Gloo
                # connectFullMesh failed ... Connection refused", seen here). One namespace per attempt.
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"dtlab/attempt{attempt}", store)
            dist.init_process_group(
                group_backend, store=store, rank=env.rank, world_size=env.world_size,
                timeout=timeout,
                # NCCL: bind the group to this rank's GPU (eager init, no device guessing).
                device_id=dev if group_backend == "nccl" else None,
            )
        yield DistContext(env=env, device=dev, backend=group_backend, threads=n_threads)
    finally:
        if destroy and dist.is_available() and dist.is_initialized():
            # Reference cycles (FSDP state, device meshes) keep process groups alive past
            # destroy_process_group(); a gloo worker thread then frees its last work object while
            # the interpreter shuts down and aborts the process ("terminate called without an
            # active exception", seen here ~1 exit in 20). Collect them while Python is alive.
            gc.collect()
            dist.destroy_process_group()
            _group_destroyed = True


def leave(code: int) -> NoReturn:
    """End a worker process with `code`. After a process group was destroyed, skip the
    interpreter's teardown: a gloo thread can still drop the last reference to a group there and
    abort the process in C++ ("terminate called without an active exception"), which the
    gc.collect() above makes rare but not impossible (seen here: 1 launch of about 320 in a test
    run). Every file is closed and the streams are flushed by now, so nothing is lost.
    lab.no_destroy_process_group keeps the teardown, to show what skipping destroy costs."""
    if not _group_destroyed:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
