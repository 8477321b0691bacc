"""Per-rank state bytes of finished runs, by kind, as a Markdown table (docs/zero.md) and JSON.

    python benchmarks/zero_bytes.py RUN_DIR [RUN_DIR ...] [--json out.json]

Reads each run's summary.json (`memory_per_rank`: exact bytes of the storages each rank holds, see
src/dtlab/strategies/state_bytes.py and src/dtlab/strategies/deepspeed_memory.py) and prints one row per run
and rank, in KiB, with each kind's share of the full model's fp32 parameter bytes (4 x n_params).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KINDS = ("param_bytes", "grad_bytes", "optim_bytes", "buffer_bytes")


def rows(run: Path) -> list[dict[str, object]]:
    s = json.loads((run / "summary.json").read_text())
    mem, full = s["memory_per_rank"], 4 * s["n_params"]
    out = []
    for rank in range(s["world_size"]):
        row: dict[str, object] = {"run": run.name, "rank": rank}
        for kind in KINDS:
            if kind in mem:
                row[kind] = mem[kind][rank]
                row[kind.replace("_bytes", "_x_P")] = round(mem[kind][rank] / full, 3)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    table = [r for run in args.runs for r in rows(run)]
    print("| run | rank | params KiB (x P) | grads KiB (x P) | optimizer KiB (x P) | buffers KiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in table:
        def cell(kind: str, r: dict[str, object] = r) -> str:
            if kind not in r:
                return "-"
            ratio = r.get(kind.replace("_bytes", "_x_P"))
            return f"{r[kind] / 1024:,.1f} ({ratio})" if kind != "buffer_bytes" else f"{r[kind] / 1024:,.1f}"
        print(f"| {r['run']} | {r['rank']} | " + " | ".join(cell(k) for k in KINDS) + " |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
