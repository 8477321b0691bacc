"""A profile file: the compute of one device, measured at a strategy's per-rank shapes, reusable.

`dtlab predict --measure --save-profile FILE` writes what the traces on this device measured:
per strategy spec, the seconds and FLOPs of each (phase, block) stretch of one step, with the
device, dtype, threads and torch version they were measured with, and the model they belong to.
`--profile FILE` (on this machine or another) prices the Compute events of a trace from it:

    seconds = measured seconds of the same (phase, block) x (FLOPs now / FLOPs measured)

from the same strategy spec where the file has it, else from any spec measured (a data-parallel
block at another micro batch, a tensor-parallel block at another width: the FLOP ratio carries
the measured efficiency over, an assumption the output names). A stretch without FLOPs (the
optimizer, copies) scales by its bytes, else is taken as measured. `--step-time S` scales every
measured second so that the profile's single-device step takes S (another machine's time, or a
published one).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError
from dtlab.predict.events import CPU_CLOCK, Compute, Trace

VERSION = 1
Key = tuple[str, int | None]  # (phase, block)


@dataclass
class Profile:
    meta: dict[str, Any]  # device, dtype, threads, torch, model, n_params, model_digest, clock
    # spec -> (phase, block) -> [seconds, flops, bytes] summed over the step's stretches
    table: dict[str, dict[Key, list[float]]] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)  # spec -> measured compute of a step
    scale: float = 1.0  # --step-time over the single-device step measured
    path: str = ""

    def add(self, spec: str, trace: Trace) -> None:
        rows: dict[Key, list[float]] = {}
        for c in trace.computes():
            if c.seconds is None:
                raise DtlabError(f"a trace of {spec} on the meta device has no seconds to profile")
            row = rows.setdefault((c.phase, c.block), [0.0, 0.0, 0.0])
            row[0] += c.seconds
            row[1] += c.flops
            row[2] += c.bytes
        self.table[spec] = rows
        self.steps[spec] = sum(r[0] for r in rows.values())

    def seconds(self, c: Compute, spec: str) -> tuple[float, str]:
        """Seconds of `c` for `spec`, and where they came from."""
        rows = [self.table[spec]] if spec in self.table else []
        rows += [t for s, t in self.table.items() if s != spec]
        for i, table in enumerate(rows):
            row = table.get((c.phase, c.block))
            if row is None:
                continue
            seconds, flops, nbytes = row
            ratio, by = ((c.flops / flops, "FLOPs") if flops > 0 and c.flops > 0 else
                         (c.bytes / nbytes, "bytes") if nbytes > 0 and c.bytes > 0 else (1.0, ""))
            where = "profile" if i == 0 and spec in self.table else "profile (another strategy)"
            if self.meta.get("clock") == CPU_CLOCK:  # ranks that outnumbered the cores
                where += (f", on a thread's CPU clock beside {self.meta.get('beside')} other "
                          "rank(s) sharing its cores")
            return seconds * ratio * self.scale, where + (f", scaled by {by}" if by and
                                                          not math.isclose(ratio, 1) else "")
        raise KeyError((c.phase, c.block))

    def scale_to(self, step_s: float) -> None:
        """Scale every second so the single-device step (spec 'single', else the fastest spec
        measured) takes `step_s`."""
        base = self.steps.get("single") or min(self.steps.values(), default=0.0)
        if base <= 0:
            raise DtlabError(f"--step-time: the profile {self.path} measured no step to scale; "
                             "fix: a profile written by dtlab predict --measure --save-profile")
        self.scale = step_s / base

    def check(self, expected: dict[str, Any]) -> None:
        """Refuse a profile of another model or dtype (one line each)."""
        for key, what in (("model_digest", "model"), ("dtype", "dtype")):
            have, want = self.meta.get(key), expected.get(key)
            if have != want:
                shown = (f"{self.meta.get('model')} ({self.meta.get('n_params'):,} parameters)"
                         if key == "model_digest" else have)
                wanted = (f"{expected.get('model')} ({expected.get('n_params'):,} parameters)"
                          if key == "model_digest" else want)
                raise DtlabError(f"--profile {self.path} was measured for {what} {shown}, not "
                                 f"{wanted}; fix: measure this config with dtlab predict "
                                 f"--measure --save-profile FILE, or drop --profile")

    def save(self, path: Path) -> None:
        from dtlab.atomic_write import write_atomic

        check_writable(path)
        data = {"dtlab_profile": VERSION, **self.meta, "steps": self.steps,
                "table": {spec: [{"phase": k[0], "block": k[1], "seconds": v[0], "flops": v[1],
                                  "bytes": v[2]} for k, v in rows.items()]
                          for spec, rows in self.table.items()}}
        text = json.dumps(data, indent=1) + "\n"
        write_atomic(Path(path), lambda draft: draft.write_text(text), "write the profile",
                     "--save-profile")


def check_writable(path: Path) -> None:
    """--save-profile replaces an earlier profile only, never another file."""
    from dtlab.atomic_write import check_replaceable

    check_replaceable(path, "a dtlab profile", lambda head: b'"dtlab_profile"' in head,
                      "another --save-profile path", "--save-profile")


def load_profile(path: str) -> Profile:
    from dtlab.cli_args import input_file

    p = Path(path)
    input_file("--profile", p, "write one with dtlab predict --measure --save-profile FILE")
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict) or data.get("dtlab_profile") != VERSION:
            raise ValueError
        table = {spec: {(r["phase"], r["block"]): [float(r["seconds"]), float(r["flops"]),
                                                   float(r["bytes"])] for r in rows}
                 for spec, rows in data.pop("table").items()}
        steps = {k: float(v) for k, v in data.pop("steps").items()}
        for key in ("model", "model_digest", "dtype"):  # what `check` names in its refusals
            str(data[key])
        data["n_params"] = int(data["n_params"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DtlabError(f"--profile {path} is not a dtlab profile file; fix: pass what dtlab "
                         "predict --measure --save-profile FILE wrote") from None
    data.pop("dtlab_profile")
    return Profile(data, table, steps, path=path)
