"""`dtlab doctor`: can this machine run distributed PyTorch, and if not, why and what to do.

Checks run in order, each returning a `Check`: the software (python, torch build, backends), the
hardware (cores, memory, /dev/shm, GPUs and their topology), the launch environment variables, the
network a launch uses (hostname, loopback, a free port, MASTER_ADDR/MASTER_PORT), and finally real
collectives between 2 processes. Each problem carries its likely cause and the fix. Exit code 0
when no check fails (warnings allowed), 1 when one does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "warn", "fail", "skip")


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    found: str
    cause: str = ""
    fix: str = ""
    data: dict = field(default_factory=dict)  # machine-readable details for --json


def ok(name: str, found: str, **data: object) -> Check:
    return Check(name, "ok", found, data=data)


def skip(name: str, found: str, **data: object) -> Check:
    return Check(name, "skip", found, data=data)


def warn(name: str, found: str, cause: str, fix: str, **data: object) -> Check:
    return Check(name, "warn", found, cause, fix, data)


def fail(name: str, found: str, cause: str, fix: str, **data: object) -> Check:
    return Check(name, "fail", found, cause, fix, data)


@dataclass(frozen=True)
class Options:
    nproc: int  # ranks per node a launch would start (threads and GPU checks use it)
    timeout_s: float  # hard limit of the collective smoke test
    smoke: bool = True


def default_nproc() -> int:
    """Ranks per node to check for: the launch's own count if set, else one per GPU, else 2."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # a broken torch is reported by the torch check  # noqa: BLE001
        gpus = 0
    return gpus or 2  # one GPU: one rank (a warning for 2 would be noise)


def guarded(producer: Callable[[], Iterable[Check]], name: str) -> list[Check]:
    """A check that crashes becomes one failed line, never a traceback that hides the others."""
    try:
        return list(producer())
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return [fail(name, f"the check itself raised {type(e).__name__}: {first}",
                     "an unexpected state of this machine (or a dtlab bug)",
                     "run the other checks' fixes first; report this line if it persists")]


def run_checks(opts: Options) -> list[Check]:
    from dtlab.doctor import environment, network, smoke, system

    checks = guarded(system.software, "software")
    torch_ok = all(c.status != "fail" for c in checks if c.name == "torch")
    checks += guarded(system.hardware, "hardware") if torch_ok else []
    checks += guarded(lambda: environment.checks(dict(os.environ), opts.nproc), "environment")
    checks += guarded(lambda: network.checks(dict(os.environ)), "network")
    if not opts.smoke:
        checks.append(skip("smoke", "collective smoke test skipped (--no-smoke)"))
    elif torch_ok:
        checks += guarded(lambda: smoke.checks(opts.timeout_s, opts.nproc), "smoke")
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


def counts(checks: list[Check]) -> dict[str, int]:
    return {s: sum(c.status == s for c in checks) for s in STATUSES}


def format_table(checks: list[Check]) -> str:
    label = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    width = max(len(c.name) for c in checks)
    lines = [f"{'STATUS':<6}  {'CHECK':<{width}}  FOUND"]
    for c in checks:
        lines.append(f"{label[c.status]:<6}  {c.name:<{width}}  {c.found}")
        indent = " " * (8 + width + 2)
        lines += [f"{indent}cause: {c.cause}"] if c.cause else []
        lines += [f"{indent}fix:   {c.fix}"] if c.fix else []
    n = counts(checks)
    code = exit_code(checks)
    plural = "s" * (n["warn"] != 1)
    lines.append(f"{len(checks)} checks: {n['ok']} ok, {n['warn']} warning{plural}, "
                 f"{n['fail']} failed, {n['skip']} skipped -> exit {code}")
    return "\n".join(lines)


def to_json(checks: list[Check], opts: Options) -> str:
    return json.dumps({
        "exit_code": exit_code(checks),
        "counts": counts(checks),
        "options": asdict(opts),
        "checks": [asdict(c) for c in checks],
    }, indent=2)


def run_doctor(as_json: bool, nproc: int | None, timeout_s: float, smoke: bool = True) -> int:
    opts = Options(nproc=nproc or default_nproc(), timeout_s=timeout_s, smoke=smoke)
    checks = run_checks(opts)
    print(to_json(checks, opts) if as_json else format_table(checks))
    return exit_code(checks)
