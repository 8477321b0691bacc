"""The pieces of a run report's HTML (dtlab/results/run_report.py): escaped cells, tables,
embedded figures, and the line a section shows when the run did not record it."""

from __future__ import annotations

import base64
import html
from typing import Any

from dtlab.results.report import STYLE
from dtlab.results.run_plots import number

MiB = 1024 * 1024
RUN_STYLE = STYLE + """
h1 { font-size: 1.6rem; } img.wide { width: 100%; max-width: 72rem; }
.warn { border: 2px solid #c00; background: #fff3f3; padding: 0.5rem 1rem; margin: 1rem 0; }
.missing { color: #666; font-style: italic; } pre { background: #f7f7f7; padding: 0.75rem; }
"""


def fmt(value: Any, spec: str) -> str:
    if not number(value):
        return "" if value is None else str(value)
    return {"ms": f"{value * 1000:.3f}", "mib": f"{value / MiB:.2f}",
            "bytes": f"{value:,.0f} B ({value / MiB:.2f} MiB)"}.get(spec) or format(value, spec)


def esc(value: Any) -> str:
    return html.escape(str(value))


def missing(what: str, how: str) -> str:
    return f"<p class='missing'>{esc(what)}: not recorded in this run ({esc(how)}).</p>"


def table(header: list[str] | None, rows: list[list[str]]) -> str:
    """Cells are escaped here; the first column is a label."""
    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>" if header else ""
    first = "<td class='text'>{}</td>" if header else "<th>{}</th>"  # a label without a header
    body = "".join("<tr>" + "".join(first.format(esc(c)) if i == 0 else f"<td>{esc(c)}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def pairs(source: dict[str, Any], items: list[tuple[str, str, str]]) -> str:
    """A two-column table of (label, key, format) for the keys that have a value."""
    return table(None, [[label, fmt(source[k], spec)] for label, k, spec in items
                        if source.get(k) not in (None, "")])


def figure(png: bytes | None, title: str, wide: bool = False) -> str:
    if png is None:
        return ""
    data, cls = base64.b64encode(png).decode(), " class='wide'" if wide else ""
    return (f"<figure><img{cls} src='data:image/png;base64,{data}' alt='{esc(title)}'>"
            f"<figcaption>{esc(title)}</figcaption></figure>")
