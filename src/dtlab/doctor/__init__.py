"""`dtlab doctor`: can this machine run distributed PyTorch, and if not, why and what to do.

Checks run in order, each returning a `Check`: the software (python, torch build, backends), the
hardware (cores, memory, /dev/shm, GPUs and their topology), the launch environment variables, the
network a launch uses (hostname, loopback, a free port, MASTER_ADDR/MASTER_PORT), and finally real
collectives between 2 processes. Each problem carries its likely cause and the fix (a `Check`:
check.py). Exit code 0 when no check fails (warnings allowed), 1 when one does. `hang.py` reads
the flight recorder's dumps of a hung run.

A command: may import every layer below the commands (it uses the flight recorder's file names,
process control and the ground); never another command.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from dtlab.doctor import environment, network, smoke, system
from dtlab.doctor.check import STATUSES, Check, guarded, skip
from dtlab.process.result_stdout import print_result


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


def run_checks(opts: Options) -> list[Check]:
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
    if as_json:
        print_result(to_json(checks, opts))
    else:
        print(format_table(checks))
    return exit_code(checks)
