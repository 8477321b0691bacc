"""What every check of `dtlab doctor` returns: a `Check` (its status, what it found, the likely
cause and the fix), the helpers that make one, and `guarded`, which turns a check that crashes
into one failed line. Its own module so that the checks (system, environment, network, smoke)
and the package that runs them import it from below."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


def guarded(producer: Callable[[], Iterable[Check]], name: str) -> list[Check]:
    """A check that crashes becomes one failed line, never a traceback that hides the others."""
    try:
        return list(producer())
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return [fail(name, f"the check itself raised {type(e).__name__}: {first}",
                     "an unexpected state of this machine (or a dtlab bug)",
                     "run the other checks' fixes first; report this line if it persists")]
