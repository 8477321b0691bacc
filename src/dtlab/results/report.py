"""`dtlab report DIR -o report.html`: one self-contained HTML file (figures embedded as data URIs,
no scripts), with findings, the environment, the figures and the table of runs."""

from __future__ import annotations

import base64
import datetime
import html
import json
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError
from dtlab.results.findings import findings
from dtlab.results.outputs import write_output

MiB = 1024 * 1024
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; color: #222; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0 1.5rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: right; }
th { background: #f3f3f3; } td.text { text-align: left; }
figure { display: inline-block; margin: 0.5rem; } img { width: 32rem; border: 1px solid #eee; }
.failed { color: #a00; }
"""
RUN_COLUMNS = [
    ("series", "series", None), ("world_size", "ranks", "{:g}"), ("status", "status", None),
    ("samples_per_s", "samples/s", "{:,.1f}"), ("median_step_time_s", "median step (ms)", "ms"),
    ("epoch_time_s", "epoch (s)", "{:.2f}"), ("peak_memory_bytes", "peak mem/rank (MiB)", "mib"),
    ("state_bytes", "state/rank (MiB)", "mib"), ("final_train_loss", "final loss", "{:.4f}"),
    ("val_loss", "val loss", "{:.4f}"), ("val_acc", "val acc", "{:.3f}"), ("reason", "reason", None),
    ("unreliable", "timings unreliable", None),
]


def _cell(value: Any, fmt: str | None) -> str:
    if value is None or value == "":
        return "<td></td>"
    if isinstance(value, (int, float)) and fmt:
        text = (f"{value * 1000:.2f}" if fmt == "ms" else f"{value / MiB:.2f}" if fmt == "mib"
                else fmt.format(value))
        return f"<td>{text}</td>"
    return f'<td class="text">{html.escape(str(value))}</td>'


def environment(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    def values(key: str) -> str:
        return ", ".join(sorted({str(r[key]) for r in rows if r.get(key) not in (None, "")})) or "-"

    return [("torch", values("torch_version")), ("dtlab", values("dtlab_version")),
            ("device", values("device")), ("device name", values("device_name")),
            ("backend", values("backend")), ("nodes", values("nnodes")),
            ("ranks", values("world_size")), ("threads per rank", values("threads_per_rank")),
            ("launcher", values("launcher")), ("hosts", values("hostname"))]


def skipped_combinations(root: Path) -> list[dict[str, str]]:
    """The combinations a sweep's plan (sweep.json) marks as unable to run; a damaged plan is
    one line, before anything is written."""
    plan = root / "sweep.json"
    if not plan.is_file():
        return []
    try:
        runs = json.loads(plan.read_bytes().decode())["runs"]
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise TypeError
    except (ValueError, TypeError, KeyError):
        raise DtlabError(f"'{plan}' is not the plan dtlab sweep writes (damaged?); fix: run the "
                         "sweep again (finished runs are found, not re-run), or move the file "
                         "out of the way") from None
    return [{"label": str(r.get("label")), "invalid": str(r["invalid"])}
            for r in runs if r.get("invalid")]


def write_report(root: Path, out: Path, rows: list[dict[str, Any]],
                 figures: list[dict[str, Any]], plots_dir: Path) -> Path:
    skipped = skipped_combinations(Path(root))
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>dtlab report: {html.escape(str(root))}</title><style>{STYLE}</style></head><body>",
             f"<h1>dtlab report: {html.escape(str(root))}</h1>",
             f"<p>{len(rows)} runs, generated {datetime.datetime.now().isoformat(timespec='seconds')}."
             " Every number below was measured by the runs listed at the end.</p>",
             "<h2>Findings</h2><ul>"]
    parts += [f"<li>{html.escape(s)}</li>" for s in findings(rows)] or ["<li>no finished runs</li>"]
    parts.append("</ul><h2>Environment</h2><table>")
    parts += [f"<tr><th>{k}</th><td class='text'>{html.escape(v)}</td></tr>" for k, v in environment(rows)]
    parts.append("</table><h2>Figures</h2>")
    for fig in figures:
        png = Path(plots_dir) / f"{fig['name']}.png"
        data = base64.b64encode(png.read_bytes()).decode()
        parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(fig['title'])}'>"
                     f"<figcaption>{html.escape(fig['title'])}</figcaption></figure>")
    parts.append("<h2>Runs</h2><table><tr>" + "".join(f"<th>{h}</th>" for _, h, _ in RUN_COLUMNS) + "</tr>")
    for r in sorted(rows, key=lambda r: (str(r.get("series")), r.get("world_size") or 0)):
        cls = "" if r.get("status") in (None, "done") else " class='failed'"
        parts.append(f"<tr{cls}>" + "".join(_cell(r.get(k), f) for k, _, f in RUN_COLUMNS) + "</tr>")
    parts.append("</table>")
    if skipped:
        parts.append("<h2>Combinations that cannot run</h2><ul>")
        parts += [f"<li>{html.escape(s['label'])}: {html.escape(s['invalid'])}</li>" for s in skipped]
        parts.append("</ul>")
    parts.append("</body></html>\n")
    return write_output(Path(out), "\n".join(parts), "report")
