"""`dtlab comm`'s files (--json, --csv), each written whole or not at all, and what a stop by a
signal writes: the results measured so far, and the one line saying where it stopped."""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.files import cause, replace_whole
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted


@dataclass
class Progress:
    """The rows measured so far (the benchmark appends to them) and what it is doing now."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    doing: str = "set-up"


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        replace_whole(Path(args.json), lambda tmp: tmp.write_text(json.dumps(rows, indent=2) + "\n"))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        replace_whole(Path(args.csv), lambda tmp: _write_csv(tmp, rows))


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    flat = []
    for row in rows:
        if "size_bytes" not in row:
            continue
        out = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for name in ("oop", "ip"):
            for k, v in (row.get(name) or {}).items():
                out[f"{name}_{k}"] = v
        flat.append(out)
    keys = list(dict.fromkeys(k for r in flat for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(flat)


def stopped(e: Interrupted, progress: Progress, args: argparse.Namespace, is_main: bool) -> int:
    """A signal stopped the benchmark: rank 0 writes the rows measured so far (the JSON ends
    with a record saying it was interrupted, and where) and says so in one line; the exit code."""
    if not is_main or e.quiet:
        return interrupt.report(e, main=False)
    rows, paths = progress.rows, [p for p in (args.json, args.csv) if p]
    e.where = f" during {progress.doing}"
    if not rows:
        e.where += "; nothing measured" + (", nothing written" if paths else "")
    elif not paths:
        e.where += f"; the {len(rows)} results measured so far are printed above"
    else:
        marker = {"op": "interrupted", "signal": interrupt.name(e.signum), "during": progress.doing}
        try:
            write_outputs([*rows, marker], args)
            e.where += f"; wrote the {len(rows)} results measured so far to {' and '.join(paths)}"
        except OSError as error:
            e.where += f"; writing the {len(rows)} results measured so far failed ({cause(error)})"
    return interrupt.report(e)
