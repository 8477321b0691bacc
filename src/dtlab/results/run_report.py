"""`dtlab report RUN_DIR`: one training run as one self-contained HTML file (figures embedded as
data URIs, no scripts): what ran, its curves, throughput and MFU, memory per rank, where a step's
time went, links to the files the run wrote, and its config.

Every section reads only what the run recorded; a section without data says so and how to get
it. A run stopped before summary.json still has its metrics.jsonl and run.json."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from dtlab.config.strategies import registry
from dtlab.results import run_plots
from dtlab.results.collect import check_shape, read_json
from dtlab.results.outputs import check_replaceable, write_output
from dtlab.results.plot import _pyplot
from dtlab.results.run_html import RUN_STYLE, MiB, esc, figure, fmt, missing, pairs, table
from dtlab.results.run_plots import PROFILE_COLUMNS, number


def is_run_dir(path: Path) -> bool:
    """One training run (not a sweep of them): it holds its own summary or metrics."""
    return (Path(path) / "summary.json").is_file() or (Path(path) / "metrics.jsonl").is_file()


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Training rows, evaluation rows and the number of unreadable lines of metrics.jsonl (a run
    killed mid-write can leave a partial last line: it costs a point, not the report)."""
    train, val, bad = [], [], 0
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            bad += bool(line.strip())
        elif "val_loss" in row or "val_acc" in row:
            val.append(row)
        elif "loss" in row:
            train.append(row)
    return train, val, bad


def header(s: dict[str, Any], rec: dict[str, Any], cfg: dict[str, Any],
           train: list[dict[str, Any]]) -> list[str]:
    if s:  # with its variant (fsdp1:SHARD_GRAD_OP, pp:gpipe), as results and compare name it
        s = {**s, "strategy": registry.label(s)}
    else:  # stopped before summary.json: what the config and the log say instead
        sub = {k: cfg[k] if isinstance(cfg.get(k), dict) else {} for k in ("strategy", "model",
                                                                           "train")}
        s = {"strategy": sub["strategy"].get("name"), "model": sub["model"].get("name"),
             "precision": sub["train"].get("precision"),
             "global_batch_size": sub["train"].get("global_batch_size")}
        if rec.get("nproc_per_node"):  # a sweep's record
            s["world_size"] = rec["nproc_per_node"] * rec.get("nnodes", 1)
        if train:
            s |= {"steps": train[-1].get("step"), "final_train_loss": train[-1].get("loss")}
    if s.get("device"):
        s["device"] = f"{s['device']} ({s['device_name']})" if s.get("device_name") else s["device"]
    out = [pairs(s, [
        ("strategy", "strategy", ""), ("world_size", "world_size", ""), ("nnodes", "nnodes", ""),
        ("device", "device", ""), ("backend", "backend", ""), ("model", "model", ""),
        ("n_params", "n_params", ","), ("precision", "precision", ""),
        ("global batch", "global_batch_size", ""), ("steps", "steps", ""),
        ("final_train_loss", "final_train_loss", ".4f"), ("val_loss", "val_loss", ".4f"),
        ("val_acc", "val_acc", ".4f"), ("wall_time_s", "wall_time_s", ".2f"),
        ("torch_version", "torch_version", ""), ("finished_at", "finished_at", "")])]
    if rec.get("status") not in (None, "done"):  # interrupted or failed: say so before anything
        code = rec.get("returncode")
        out.insert(0, f"<div class='warn'><b>run {esc(rec['status'])}</b>"
                   + (f": {esc(rec['reason'])}" if rec.get("reason") else "")
                   + (f" (exit code {esc(code)})" if code is not None else "") + "</div>")
    unreliable = (s.get("timing") or {}).get("unreliable") or []
    if unreliable:
        out.insert(0, "<div class='warn'><b>Timings unreliable: do not trust the times, rates "
                   "or MFU of this run.</b><ul>" + "".join(f"<li>{esc(u)}</li>" for u in unreliable)
                   + "</ul>Rerun on an idle machine with ranks x threads &lt;= cores.</div>")
    return out


def curves(train: list[dict[str, Any]], val: list[dict[str, Any]], bad: int) -> list[str]:
    if not train and not val:
        return [missing("curves", "metrics.jsonl is written every run.log_every steps")]
    return [figure(run_plots.curves(train, val), "Loss, learning rate and throughput by step",
                   wide=True)] + ([f"<p>{bad} unreadable line(s) of metrics.jsonl skipped.</p>"]
                                  if bad else [])


def throughput(s: dict[str, Any], train: list[dict[str, Any]]) -> list[str]:
    if not s:
        rates = [r["samples_per_s"] for r in train if number(r.get("samples_per_s"))]
        if not rates:
            return [missing("throughput and MFU", "summary.json is written when the run finishes")]
        return [f"<p>median of the logged samples/s: {statistics.median(rates):,.1f} (from "
                "metrics.jsonl; MFU is computed only for a finished run's summary.json)</p>"]
    out = [pairs(s, [("samples/s", "samples_per_s", ",.1f"), ("tokens/s", "tokens_per_s", ",.0f"),
                     ("median step (ms)", "median_step_time_s", "ms"),
                     ("TFLOP/s per rank (model)", "tflops_per_rank", ".4g"),
                     ("TFLOP/s per rank (hardware)", "hardware_tflops_per_rank", ".4g"),
                     ("peak TFLOP/s", "peak_tflops", ".4g"), ("MFU", "mfu", ".1%")])]
    note = f": {esc(s['mfu_note'])}" if s.get("mfu_note") else ""  # what the peak is
    return out + [f"<p>MFU{note}</p>" if number(s.get("mfu"))
                  else f"<p>MFU not reported{note}.</p>"]


def memory(s: dict[str, Any]) -> list[str]:
    mem = {k: v for k, v in (s.get("memory_per_rank") or {}).items()
           if isinstance(v, list) and v and all(number(x) for x in v)}
    if not mem:
        return [missing("memory per rank", "summary.json is written when the run finishes")]
    rows = [[str(r)] + [fmt(v[r], "mib") if r < len(v) else "" for v in mem.values()]
            for r in range(max(map(len, mem.values())))]
    return [table(["rank"] + [f"{k.removesuffix('_bytes')} (MiB)" for k in mem], rows),
            figure(run_plots.memory(mem), "Memory per rank (MiB)")]


def profile(p: Any) -> list[str]:
    if not isinstance(p, dict) or not (p.get("table") or p.get("median")):
        return [missing("profiler window", "run with run.profile.steps=3, from step "
                        "run.profile.start (5); run.profile.memory=true adds the memory timeline")]
    rows = [[str(r.get("step", ""))] + [fmt(r.get(k), "ms") for k, _ in PROFILE_COLUMNS]
            for r in p.get("table") or [] if isinstance(r, dict)]
    median = p.get("median") if isinstance(p.get("median"), dict) else {}
    if median:
        rows.append(["median"] + [fmt(median.get(k), "ms") for k, _ in PROFILE_COLUMNS])
    steps = ", ".join(map(str, p.get("steps") or []))
    peak = p.get("memory_peak_by_category") or {}
    held = ([f"<p>Memory at the window's peak on rank 0 (PyTorch's categories): "
             f"{esc(', '.join(f'{k} {v / MiB:,.2f} MiB' for k, v in peak.items()))}.</p>"]
            if isinstance(peak, dict) and peak else
            [f"<p>Memory timeline withheld: {esc(p['memory_timeline_error'])}</p>"]
            if p.get("memory_timeline_error") else [])
    return [f"<p>Profiled steps {esc(steps)}, times in ms. Overlapped communication ran under "
            "compute and adds no time; exposed communication is what the step waited for.</p>",
            table(["step"] + [label for _, label in PROFILE_COLUMNS], rows),
            figure(run_plots.step_breakdown(median), "Median step by part (ms)", wide=True), *held]


def comm(s: dict[str, Any]) -> list[str]:
    c = s.get("comm_breakdown")
    if not isinstance(c, dict):
        return [missing("communication breakdown", "run 2 ranks or more with "
                        "run.comm_breakdown=true")]
    out = [pairs(c, [("step (ms)", "step_time_s", "ms"), ("compute (ms)", "compute_time_s", "ms"),
                     ("exposed comm (ms)", "exposed_comm_s", "ms"),
                     ("overlapped comm (ms)", "overlapped_comm_s", "ms"),
                     ("other overhead (ms)", "other_overhead_s", "ms"),
                     ("comm share of step", "comm_share", ".1%"),
                     ("payload per step", "payload_bytes_per_step", "bytes"),
                     ("traffic per step", "traffic_bytes_per_step", "bytes"),
                     ("analytic traffic per step", "analytic_traffic_bytes_per_step", "bytes"),
                     ("collectives per step", "calls_per_step", "")])]
    ops = c.get("by_op") or {}
    if ops:
        out.append(table(["collective", "calls/step", "payload/step", "ms/step", "sizes (bytes)"],
                         [[op, fmt(o.get("calls"), ""), fmt(o.get("payload_bytes"), "bytes"),
                           fmt(o.get("seconds_per_step"), "ms"),
                           ", ".join(f"{b:,}" for b in o.get("sizes") or [])]
                          for op, o in sorted(ops.items())]))
    measured, analytic = c.get("traffic_bytes_per_step"), c.get("analytic_traffic_bytes_per_step")
    line = f"measured traffic {fmt(measured, 'bytes')} per step"
    if number(analytic) and analytic and number(measured):
        line += (f", analytic {fmt(analytic, 'bytes')}; "
                 f"measured/analytic = {measured / analytic:.2f}")
    else:
        line += "; no analytic model for this strategy"
    return out + [f"<h3>Communication volume: measured traffic vs analytic</h3><p>{esc(line)}</p>"]


# (pattern under RUN_DIR, what to do with it); the newest checkpoint is added separately
PERFETTO = "open in https://ui.perfetto.dev"
FILES = [("profile/trace_rank*.json", PERFETTO), ("trace_rank*.json", PERFETTO),
         ("profile/*.html", "the profiler's memory timeline: open in a browser"),
         ("memory/*.html", "PyTorch's memory viewer, offline: open in a browser"),
         ("memory/*.pickle", "PyTorch memory snapshot: drag into https://pytorch.org/memory_viz"),
         ("flight_recorder/rank*.json", "read with `dtlab doctor hang RUN_DIR`"),
         ("model.safetensors", "the final model (run.save_model=true)"),
         ("metrics.jsonl", "one JSON object per logged step"),
         ("summary.json", "every number of this report"), ("run.json", "how the run ended"),
         ("config.yaml", "the resolved config, as below")]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (its manifest written last), found without importing torch
    as dtlab.run.checkpoint would."""
    found = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", p.name))
             and (p / "dtlab-checkpoint.json").is_file()]
    return max(found)[1] if found else None


def file_links(run_dir: Path, out: Path) -> list[str]:
    # Relative hrefs, so that the links still work when the run directory is copied or moved.
    items: list[tuple[Path, str]] = []
    for pattern, note in FILES:
        items += [(p, note) for p in sorted(run_dir.glob(pattern))
                  if p.is_file() and p.resolve() != out.resolve()]
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        # what continues it whoever started the run (compare's config says resume=none), on the
        # ranks that wrote it, here (a copied or moved run directory's config names the old place)
        ranks = (read_json(ckpt / "dtlab-checkpoint.json") or {}).get("world_size")
        nproc = f" --nproc-per-node {ranks}" if isinstance(ranks, int) and ranks > 1 else ""
        again = f"dtlab train{nproc} --config {run_dir / 'config.yaml'} resume=auto run.dir={run_dir}"
        items.append((ckpt, f"the latest checkpoint (`{again}` continues from it; "
                            "`dtlab export` makes a model file of it)"))
    if not items:
        return ["<p class='missing'>no files besides this report.</p>"]
    base = out.resolve().parent
    links = []
    for path, note in items:
        href = quote(Path(os.path.relpath(path.resolve(), base)).as_posix())
        links.append(f"<li><a href='{esc(href)}'>{esc(path.relative_to(run_dir).as_posix())}</a>: "
                     f"{esc(note)}</li>")
    return ["<ul>" + "".join(links) + "</ul>"]


def stopped_ranks(run_dir: Path) -> dict[str, str]:
    """A failed run writes no run.json, but its ranks' flight-recorder dumps say why each
    stopped (dtlab/instruments/flight_recorder.py)."""
    reasons = []
    for path in sorted((run_dir / "flight_recorder").glob("rank*.json")):
        head = (read_json(path) or {}).get("dtlab") or {}
        if head.get("reason"):
            reasons.append(f"rank {head.get('rank')}: {head['reason']}")
    return {"status": "stopped", "reason": " | ".join(reasons) + "; `dtlab doctor hang "
            "RUN_DIR` reads the dumps"} if reasons else {}


def write_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """RUN_DIR/report.html (or `out`) for one run; returns its path."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "report.html"
    _pyplot()  # refuses in one line, before anything is read or written, without matplotlib
    check_replaceable(out, "report")
    s = check_shape(run_dir / "summary.json", read_json(run_dir / "summary.json"))
    rec = check_shape(run_dir / "run.json", read_json(run_dir / "run.json"))
    if not rec.get("status"):
        rec = {**rec, **stopped_ranks(run_dir)}
    train, val, bad = read_metrics(run_dir / "metrics.jsonl")
    config_path = run_dir / "config.yaml"
    config = config_path.read_text(errors="replace") if config_path.is_file() else None
    try:
        cfg = yaml.safe_load(config or "") if not s else {}
    except yaml.YAMLError:  # the config is shown verbatim below; the header just has less
        cfg = {}
    name = run_dir.resolve().name
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>dtlab run report: {esc(name)}</title><style>{RUN_STYLE}</style></head><body>",
             f"<h1>dtlab run report: {esc(name)}</h1>",
             f"<p>{esc(run_dir.resolve())}, report generated "
             f"{datetime.datetime.now().isoformat(timespec='seconds')}"
             + ("" if s else "; the run wrote no summary.json (stopped, or still running): "
                "the numbers come from config.yaml and metrics.jsonl") + ".</p>",
             *header(s, rec, cfg if isinstance(cfg, dict) else {}, train),
             "<h2>Curves</h2>", *curves(train, val, bad),
             "<h2>Throughput and MFU</h2>", *throughput(s, train),
             "<h2>Memory per rank</h2>", *memory(s),
             "<h2>Step breakdown</h2><h3>Profiler window</h3>", *profile(s.get("profile")),
             "<h3>Compute and communication</h3>", *comm(s),
             "<h2>Files</h2>", *file_links(run_dir, out),
             "<h2>Config</h2>", f"<pre>{esc(config)}</pre>" if config is not None else
             missing("config", "config.yaml is written when the run starts")]
    parts.append("</body></html>\n")
    write_output(out, "\n".join(parts), "report")
    return out
