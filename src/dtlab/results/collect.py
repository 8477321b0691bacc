"""`dtlab collect DIR -o results.csv`: one row per run.

dtlab runs are found by their `summary.json` (finished) or `run.json` (a sweep's record, also for
runs that failed; a stopped run's, whose strategy and world size unfinished.py reads from what
else it left). Logs of other scripts (`*.log`, `*.out`, `*.txt` outside dtlab run directories)
contribute one row each from their `[METRIC] key=value` lines, later values winning.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from dtlab.config.load import flatten
from dtlab.config.strategies import registry
from dtlab.errors import DtlabError
from dtlab.results.unfinished import unfinished_run

RANK_KEYS = ("nproc_per_node", "nnodes")  # the x axis, not a series
# keys that name a strategy variant: part of the strategy label, not of the series
STRATEGY_KEYS = ("strategy.name", *(s.variant[0] for s in registry.SPECS.values() if s.variant))
COLUMNS = [
    "series", "strategy", "world_size", "nnodes", "status", "reason", "model", "n_params", "data",
    "precision", "global_batch_size", "micro_batch_size", "grad_accum_steps", "steps",
    "steps_per_epoch", "epoch_time_s", "epoch_time_measured", "median_step_time_s",
    "samples_per_s", "tokens_per_s", "tflops_per_rank", "mfu", "final_train_loss", "val_loss", "val_acc",
    "peak_memory_bytes", "peak_reserved_bytes", "param_bytes", "grad_bytes", "optim_bytes",
    "state_bytes", "comm_share", "loss_dev", "param_dev", "backend", "device", "device_name", "threads_per_rank",
    "launcher", "torch_version", "dtlab_version", "hostname", "wall_time_s", "key", "source",
]
METRIC = re.compile(r"\[METRIC\]\s+(.*)")


def read_json(path: Path) -> dict[str, Any]:
    """A run's JSON record; a damaged one is named with the fix, not a traceback."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes().decode())
    except (ValueError, OSError):
        data = None
    if not isinstance(data, dict):
        raise DtlabError(f"'{path}' is not a dtlab JSON record (damaged?); fix: re-run that run, "
                         f"or move its directory '{path.parent}' out of the way")
    return data


# The sections of summary.json and run.json that are read by shape, and the shape they must have
SHAPES = {"summary.json": {"memory_per_rank": dict, "timing": dict, "pipeline": dict,
                           "strategy_options": dict, "profile": dict, "comm_breakdown": dict},
          "run.json": {"combo": dict, "nproc_per_node": int, "nnodes": int}}


def check_shape(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` (read_json of `path`), refused in one line when a section has another shape than
    dtlab writes (a hand-edited or damaged record); returned as it is otherwise."""
    shapes = SHAPES.get(path.name, {})
    bad = [k for k, kind in shapes.items() if data.get(k) is not None
           and (not isinstance(data[k], kind) or isinstance(data[k], bool))]
    mem = data.get("memory_per_rank") if path.name == "summary.json" else None
    if isinstance(mem, dict):
        bad += [f"memory_per_rank.{k}" for k, v in mem.items() if not isinstance(v, list)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)]
    for key in ("timing", "comm_breakdown"):
        inner = data.get(key) if path.name == "summary.json" else None
        field = {"timing": "unreliable", "comm_breakdown": "by_op"}[key]
        if isinstance(inner, dict) and inner.get(field) is not None and not isinstance(
                inner[field], list if key == "timing" else dict):
            bad.append(f"{key}.{field}")
    if bad:
        raise DtlabError(f"'{path}' is not a dtlab JSON record ({', '.join(bad)} has another shape; "
                         f"damaged or edited?); fix: re-run that run, or move its directory "
                         f"'{path.parent}' out of the way")
    return data


def row_from_run(run_dir: Path, root: Path) -> dict[str, Any]:
    s = check_shape(run_dir / "summary.json", read_json(run_dir / "summary.json"))
    rec = check_shape(run_dir / "run.json", read_json(run_dir / "run.json"))
    mem = s.get("memory_per_rank", {})
    parts = [mem.get(k) or [] for k in ("param_bytes", "grad_bytes", "optim_bytes")]
    state = [sum(v) for v in zip(*parts, strict=True)] if len(set(map(len, parts))) == 1 else []
    row: dict[str, Any] = {k: s.get(k) for k in COLUMNS if k in s}
    peak = mem.get("peak_allocated_bytes") or mem.get("peak_rss_bytes") or []
    # A sweep records its runs' ranks in run.json; a `dtlab train` stopped early records only
    # how it ended there, and its other files tell the rest.
    ranks = rec["nproc_per_node"] * rec.get("nnodes", 1) if "nproc_per_node" in rec else None
    left = unfinished_run(run_dir) if not s else {}
    row.update(
        strategy=(registry.label(s) or left.get("strategy")
                  or rec.get("combo", {}).get("strategy.name")),
        world_size=s.get("world_size") or ranks or left.get("world_size"),
        nnodes=s.get("nnodes") or rec.get("nnodes"),
        status=rec.get("status", "done" if s else "unknown"),
        reason=rec.get("reason", ""),
        peak_memory_bytes=max(peak) if peak else None,
        state_bytes=max(state) if state else None,
        key=rec.get("key", ""),
        source=str(run_dir.relative_to(root)) if run_dir != root else ".",
    )
    row["unreliable"] = "; ".join((s.get("timing") or {}).get("unreliable") or []) or None
    for k in ("peak_reserved_bytes", "param_bytes", "grad_bytes", "optim_bytes"):  # the largest rank
        row[k] = max(mem[k]) if mem.get(k) else None
    pipe = s.get("pipeline")
    if pipe:  # strategy pp: the measured bubble next to the theory
        row.update({f"pp_{k}": pipe[k] for k in ("microbatches", "stages_per_rank",
                                                 "bubble_measured", "bubble_theory")})
    varied = {k: v for k, v in rec.get("combo", {}).items()
              if k not in RANK_KEYS and k not in STRATEGY_KEYS}
    row["series"] = ", ".join([row["strategy"] or "?"] + [f"{k}={v}" for k, v in varied.items()])
    return row


def add_verification(rows: list[dict[str, Any]], root: Path) -> None:
    """`dtlab compare --verify` deviations from single, when the directory is a comparison."""
    path = root / "compare.json"
    if not path.is_file():
        return
    try:
        table = json.loads(path.read_bytes().decode())
        if not isinstance(table, list):
            raise TypeError
        checked = {r["strategy"]: (float(r["loss_dev"]), float(r["param_dev"]))
                   for r in table if "loss_dev" in r}
    except (ValueError, TypeError, KeyError):
        raise DtlabError(f"'{path}' is not what dtlab compare writes (damaged?); fix: run the "
                         "comparison again, or move the file out of the way") from None
    for row in rows:
        match = checked.get(str(row.get("series")))
        if match:
            row["loss_dev"], row["param_dev"] = match


def parse_number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def row_from_log(path: Path, root: Path) -> dict[str, Any] | None:
    values: dict[str, Any] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = METRIC.search(line)
        if m:
            for item in m.group(1).split():
                key, sep, value = item.partition("=")
                if sep:
                    values[key] = parse_number(value)
    if not values:
        return None
    label = values.get("strategy", path.stem)
    return {"series": str(label), "status": "done", **values, "source": str(path.relative_to(root))}


def collect(*roots: Path) -> list[dict[str, Any]]:
    rows, seen = [], set()  # a run reached through two of the roots is one row
    for root in map(Path, roots):
        if not root.is_dir():
            raise DtlabError(f"'{root}' is not a directory; fix: pass the directory of a sweep, "
                             "a compare or a set of logs")
        run_dirs = sorted({p.parent for name in ("summary.json", "run.json")
                           for p in root.rglob(name)})
        fresh = [d for d in run_dirs if d.resolve() not in seen]
        twice = len(run_dirs) - len(fresh)
        found = [row_from_run(d, root) for d in fresh]
        add_verification(found, root)
        for path in sorted(root.rglob("*")):
            if path.suffix in (".log", ".out", ".txt") and path.is_file() and not any(
                    d == path.parent or d in path.parents for d in run_dirs):
                row = row_from_log(path, root)
                if row and path.resolve() in seen:
                    twice += 1
                elif row:
                    found.append(row)
                    seen.add(path.resolve())
        seen.update(d.resolve() for d in run_dirs)
        if not found and twice:
            raise DtlabError(f"'{root}' holds only runs that an earlier DIR holds, which would "
                             "count them twice; fix: pass each directory once")
        if not found:
            raise DtlabError(f"'{root}' holds no dtlab runs (summary.json, run.json) and no logs "
                             "with [METRIC] lines; fix: pass the directory of a sweep, a compare "
                             "or a set of logs")
        if len(roots) > 1:  # which DIR each row came from: two sweeps' runs share their keys
            for r in found:
                r["source"] = str(root / r["source"]) if r["source"] != "." else str(root)
        rows += found
    told_apart(rows, roots)
    return sorted(rows, key=lambda r: (str(r.get("series")), r.get("world_size") or 0))


def told_apart(rows: list[dict[str, Any]], roots: tuple[Path, ...]) -> None:
    """Runs that would share a series and a world size (two `dtlab train` runs of one strategy
    with another learning rate, say) get the config keys they differ in added to their series
    (read from each run's config.yaml): a plot would otherwise draw them as one line."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((str(row.get("series")), row.get("world_size")), []).append(row)
    for same in (g for g in groups.values() if len(g) > 1):
        configs = [_settings(_run_dir(row, roots)) for row in same]
        keys = sorted({k for c in configs for k in c
                       if len({repr(other.get(k)) for other in configs}) > 1})
        for row, config in zip(same, configs, strict=True):
            if keys:
                row["series"] += ", " + ", ".join(f"{k}={config.get(k)}" for k in keys)


def _run_dir(row: dict[str, Any], roots: tuple[Path, ...]) -> Path:
    source = Path(row["source"])
    return source if len(roots) > 1 or source.is_absolute() else Path(roots[0]) / source


def _settings(run_dir: Path) -> dict[str, Any]:
    """A run's config.yaml as dotted keys, without where and how it reports (run.*)."""
    import yaml

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    flat = flatten(config) if isinstance(config, dict) and config else {}
    return {k: v for k, v in flat.items() if not k.startswith("run.")}


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    from dtlab.results.outputs import write_output

    extra = sorted({k for r in rows for k in r} - set(COLUMNS))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS + extra, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return write_output(path, text.getvalue(), "csv")


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV file; one that is missing, binary or has no rows is a DtlabError."""
    if not Path(path).is_file():
        raise DtlabError(f"'{path}' not found; fix: write it with `dtlab collect DIR -o {path}`")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise DtlabError(f"'{path}' is not a CSV file ({e.__class__.__name__}); fix: pass a CSV "
                         "written by `dtlab collect` or `dtlab comm --csv`") from None
    if not rows:
        raise DtlabError(f"'{path}' holds no rows; fix: pass a CSV with results, written by "
                         "`dtlab collect` or `dtlab comm --csv`")
    return [{k: parse_number(v) if v not in ("", None) else None for k, v in r.items()
             if k is not None} for r in rows]
