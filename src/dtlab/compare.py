"""`dtlab compare`: one config, several strategies, one table (and CSV/JSON).

Each strategy runs as its own `dtlab train` process, one after another, in `OUT/<label>/`.
With --verify, every strategy's per-step losses and final parameters are checked against `single`
at the same global batch: the largest relative deviation is printed, and exceeding the tolerance
makes the command exit 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from dtlab.config import PP_SCHEDULES, SHARDING_STRATEGIES, STRATEGIES, load_config
from dtlab.config.schema import MODEL_PARALLEL
from dtlab.errors import ConfigError

MiB = 1024 * 1024


def parse_shape(spec: str, shape: str) -> tuple[int, int]:
    """`2x2` -> (data-parallel, model-parallel) ranks; `2` -> (1, 2)."""
    parts = shape.split("x")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--strategies: '{spec}' has a bad mesh shape '{shape}'; fix: @MP or @DPxMP with "
            "positive integers, e.g. fsdp_tp@2x2 (2 replicas x 2 tensor-parallel ranks)"
        )
    dims = [int(p) for p in parts]
    return (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])


def parse_spec(spec: str) -> list[str]:
    """A strategy spec -> the overrides selecting it.

    `NAME[:VARIANT][@SHAPE]`: fsdp1 takes a sharding strategy (`fsdp1:SHARD_GRAD_OP`), pp a
    schedule (`pp:interleaved_1f1b`), deepspeed its ZeRO stage (`deepspeed:3`); tp, fsdp_tp and pp take a mesh shape, `@MP` or `@DPxMP`
    (`fsdp_tp@2x2`: 2 data-parallel replicas x 2 tensor-parallel ranks; see `spec_ranks`).
    """
    head, _, shape = spec.partition("@")
    name, _, variant = head.partition(":")
    if name not in STRATEGIES:
        raise ConfigError(f"--strategies: unknown strategy '{name}'; fix: use {', '.join(STRATEGIES)}")
    overrides = [f"strategy.name={name}"]
    if variant:
        if name == "fsdp1" and variant in SHARDING_STRATEGIES:
            overrides.append(f"strategy.fsdp1.sharding_strategy={variant}")
        elif name == "pp" and variant in PP_SCHEDULES:
            overrides.append(f"strategy.pp.schedule={variant}")
        elif name == "deepspeed" and variant in ("1", "2", "3"):  # deepspeed:3 = ZeRO stage 3
            overrides.append(f"strategy.deepspeed.zero_stage={variant}")
        else:
            raise ConfigError(
                f"--strategies: '{spec}' is not valid; fix: only fsdp1 takes a variant ("
                + ", ".join(SHARDING_STRATEGIES) + "), pp a schedule (" + ", ".join(PP_SCHEDULES)
                + ") and deepspeed its ZeRO stage (deepspeed:1, :2 or :3)"
            )
    if shape:
        if name not in MODEL_PARALLEL:
            raise ConfigError(
                f"--strategies: '{spec}': only {', '.join(MODEL_PARALLEL)} take a mesh shape; "
                "fix: remove the @ part"
            )
        _, mp = parse_shape(spec, shape)
        overrides.append(f"strategy.{'pp' if name == 'pp' else 'tp'}.degree={mp}")
    return overrides


def spec_ranks(spec: str, default: int) -> int:
    """Ranks a spec runs on: 1 for single, the mesh's size when it has one, else `default`."""
    shape = spec.partition("@")[2]
    if shape:
        dp, mp = parse_shape(spec, shape)
        return dp * mp
    return 1 if spec == "single" else default


def run_label(spec: str) -> str:
    """The spec as a directory name."""
    return spec.replace(":", "-").replace("@", "-")


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[float]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [
        r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    return summary, losses


def loss_deviation(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True))


def param_deviation(path: Path, reference: Path) -> float:
    """max over tensors of max|p - p_ref| / max|p_ref|."""
    from safetensors.torch import load_file

    a, b = load_file(str(path)), load_file(str(reference))
    if a.keys() != b.keys():
        return float("inf")
    return max(
        ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b
    )


def row_for(label: str, s: dict[str, Any]) -> dict[str, Any]:
    mem = s["memory_per_rank"]
    peak_key = "peak_allocated_bytes" if "peak_allocated_bytes" in mem else "peak_rss_bytes"
    state = [sum(v) for v in zip(mem["param_bytes"], mem["grad_bytes"], mem["optim_bytes"], strict=True)]
    comm = {}
    if s.get("comm_share") is not None:  # run.comm_breakdown=true
        comm = {"comm_share_pct": round(100 * s["comm_share"], 1),
                "exposed_comm_ms": round(1000 * s["exposed_comm_s"], 2),
                "comm_mib_per_step": round(s["comm_breakdown"]["payload_bytes_per_step"] / MiB, 3)}
    return {
        "strategy": label,
        "ranks": s["world_size"],
        "samples_per_s": round(s["samples_per_s"], 1),
        "step_time_ms": round(1000 * s["median_step_time_s"], 2),
        "peak_mem_mib": round(max(mem[peak_key]) / MiB, 1),
        "param_mib": round(max(mem["param_bytes"]) / MiB, 3),
        "state_mib": round(max(state) / MiB, 3),
        "final_loss": round(s["final_train_loss"], 6),
        "val_acc": round(s["val_acc"], 4) if s.get("val_acc") is not None else None,
        **comm,
    }


def columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))  # single has no communication columns


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = columns(rows)
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols))


def compare(args: argparse.Namespace) -> int:
    specs = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.verify and "single" not in specs:
        specs.insert(0, "single")  # the reference
    plans = {spec: parse_spec(spec) for spec in specs}
    load_config(args.config, args.overrides)  # report config mistakes before running anything
    out = Path(args.out)
    extra = ["run.progress=false"] + (["run.log_every=1", "run.save_model=true"] if args.verify else [])
    rows, failed, results = [], [], {}
    for spec, spec_overrides in plans.items():
        label = run_label(spec)
        nproc = spec_ranks(spec, args.nproc_per_node)
        cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc)]
        cmd += ["--config", args.config] if args.config else []
        cmd += [*args.overrides, *spec_overrides, *extra, f"run.dir={out / label}"]
        print(f"== {spec} on {nproc} rank(s)", flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode:
            failed.append(f"{spec} (exit code {proc.returncode})")
            continue
        results[spec] = read_run(out / label)
        rows.append(row_for(spec, results[spec][0]))

    bad = []
    if args.verify and "single" in results:
        ref_losses = results["single"][1]
        for row in rows:
            spec = row["strategy"]
            dl = loss_deviation(results[spec][1], ref_losses)
            dp = param_deviation(out / run_label(spec) / "model.safetensors",
                                 out / "single" / "model.safetensors")
            row["loss_dev"], row["param_dev"] = f"{dl:.2e}", f"{dp:.2e}"
            if max(dl, dp) > args.tolerance:
                bad.append(f"{spec}: loss deviation {dl:.2e}, parameter deviation {dp:.2e}")
    if rows:
        print()
        print_table(rows)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "compare.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns(rows))
            writer.writeheader()
            writer.writerows(rows)
        (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwritten: {out / 'compare.csv'}")
    if args.verify and "single" in results:
        n = len(results["single"][1])
        verdict = "FAILED" if bad else "passed"
        print(f"verify {verdict}: {n} steps vs single, tolerance {args.tolerance:g} (relative)")
        for line in bad:
            print(f"  {line}")
    for line in failed:
        print(f"dtlab: error: run failed: {line}", file=sys.stderr)
    return 1 if (failed or bad) else 0
