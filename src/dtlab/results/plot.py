"""`dtlab plot results.csv [comm.csv] -o plots/`: the figures a scaling study needs, PNG and SVG.

One series per strategy (plus whatever else the sweep varied), x = number of ranks. Every figure
is described in plots/index.json (title, axis labels, series) so that reports and tests can read
what was drawn. The directory is claimed (dtlab.owned, kind "plot") before anything is drawn: a
file of one of the names plot writes that an earlier plot did not write there is refused, and
every file is recorded before it is written, so that the next plot may replace it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab import owned
from dtlab.errors import DtlabError

MiB = 1024 * 1024
# Every figure plot_results can draw: the names it may write are claimed whole before the data
# decides which are drawn (a user's throughput.png is refused even where this plot draws none).
FIGURES = ("epoch_time", "throughput", "scaling_efficiency", "val_loss", "val_acc", "peak_memory",
           "state_bytes", "comm_share", "busbw")
EXTENSIONS = ("png", "svg")
WRITES = ("index.json", *(f"{name}.{ext}" for name in FIGURES for ext in EXTENSIONS))


def claim_plots(out_dir: Path, flag: str = "-o/--output",
                elsewhere: str = "choose another directory") -> owned.Owned:
    """The right to write plot's files into out_dir (NotOurs, in one line, when a file of theirs
    there is not plot's); writes nothing."""
    return owned.claim(Path(out_dir), "plot", "plot", WRITES, flag, elsewhere=elsewhere)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise DtlabError("plotting needs matplotlib; fix: pip install 'dtlab[plot]'") from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.fonttype": "none", "figure.dpi": 100, "savefig.dpi": 120,
                                "axes.grid": True, "grid.alpha": 0.3,
                                "axes.formatter.useoffset": False})
    import matplotlib.pyplot as plt

    return plt


def points(rows: list[dict[str, Any]], x_key: str, y_key: str,
           label: Callable[[dict[str, Any]], str]) -> dict[str, list[tuple[float, float]]]:
    """{label: [(x, y), ...]} over finished rows with a finite number in both columns, x
    positive (ranks, sizes: a hand-edited 0 would divide by zero in `scaling`)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        x, y = r.get(x_key), r.get(y_key)
        if (r.get("status") in (None, "done") and isinstance(x, (int, float))
                and isinstance(y, (int, float)) and math.isfinite(x) and math.isfinite(y) and x > 0):
            out[label(r)].append((x, y))
    return {k: sorted(v) for k, v in sorted(out.items())}


def series_points(rows: list[dict[str, Any]], column: str) -> dict[str, list[tuple[float, float]]]:
    """{series: [(ranks, value), ...]}"""
    return points(rows, "world_size", column,
                  lambda r: str(r.get("series") or r.get("strategy") or "run"))


def scaling(points: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(ranks, ideal throughput, efficiency) against linear scaling from the fewest ranks."""
    n0, t0 = points[0]
    return [(n, t0 * n / n0, t / (t0 * n / n0)) for n, t in points]


class Figures:
    def __init__(self, out_dir: Path, mine: owned.Owned) -> None:
        self.plt, self.out_dir, self.index, self.mine = _pyplot(), Path(out_dir), [], mine

    def line(self, name: str, title: str, xlabel: str, ylabel: str,
             data: dict[str, list[tuple[float, float]]], logy: bool = False,
             logx: bool = True, ideal: dict[str, list[tuple[float, float]]] | None = None,
             hline: float | None = None, from_zero: bool = False) -> None:
        if not data:
            return
        fig, ax = self.plt.subplots(figsize=(6.4, 4.2))
        for label, pts in data.items():
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            if ideal and label in ideal:
                ax.plot([p[0] for p in ideal[label]], [p[1] for p in ideal[label]], ls="--",
                        color=line.get_color(), alpha=0.6, label=f"{label} (ideal linear)")
        if hline is not None:
            ax.axhline(hline, ls="--", color="gray", label="ideal")
        xs = sorted({p[0] for pts in data.values() for p in pts})
        if logx and len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        if logy:
            ax.set_yscale("log")
        elif from_zero:  # quantities whose zero matters (bytes, samples/s): no exaggerated gaps
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
        else:  # show at least +-1% around the data, so rounding noise is not drawn as a trend
            ys = [p[1] for pts in data.values() for p in pts]
            mid, half = (max(ys) + min(ys)) / 2, max((max(ys) - min(ys)) / 2, 0.01 * abs(max(ys)))
            ax.set_ylim(mid - 1.1 * half, mid + 1.1 * half)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize="small")
        self.save(fig, name, title, xlabel, ylabel, list(data))

    def save(self, fig: Any, name: str, title: str, xlabel: str, ylabel: str,
             series: list[str]) -> None:
        fig.tight_layout()
        if name not in FIGURES:  # its files would be written unclaimed
            raise AssertionError(f"figure '{name}' is missing from plot.FIGURES")
        files = [f"{name}.{ext}" for ext in EXTENSIONS]
        self.mine.add(*files)  # recorded first: a write cut short is still ours to replace
        for file in files:
            fig.savefig(self.out_dir / file)
        self.plt.close(fig)
        self.index.append({"name": name, "title": title, "xlabel": xlabel, "ylabel": ylabel,
                           "series": series, "files": files})


def check_plottable(rows: list[dict[str, Any]], path: Path,
                    comm_rows: list[dict[str, Any]] | None = None) -> None:
    """Refuse, before anything is written, results with nothing to draw."""
    if not any("world_size" in r for r in rows):
        raise DtlabError(f"'{path}' has no world_size column; fix: pass a CSV written by "
                         "`dtlab collect`")
    numeric = ("samples_per_s", "epoch_time_s", "val_loss", "val_acc", "peak_memory_bytes",
               "state_bytes", "comm_share")
    if comm_rows and not points(comm_rows, "size_bytes", "busbw_gbps", str):
        raise DtlabError("the collective results have no size_bytes/busbw_gbps columns; fix: pass "
                         "a CSV written by `dtlab comm --csv`")
    if not comm_rows and not any(series_points(rows, c) for c in numeric):
        raise DtlabError(f"'{path}' has no finished run with numbers to plot (status done, "
                         "world_size and samples_per_s...); fix: collect finished runs first")


def plot_results(rows: list[dict[str, Any]], out_dir: Path,
                 comm_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    if rows and not any("world_size" in r for r in rows):
        raise DtlabError("the results have no world_size column; fix: pass a CSV written by "
                         "`dtlab collect`")
    mine = claim_plots(out_dir)  # callers with another flag claim first, with their own words
    mine.add()  # the directory and its record, before the first figure
    # Drawn aside, then swapped in: a plot stopped half way (Ctrl-C) leaves the earlier one whole.
    staging = Path(out_dir) / f".plot-{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        index = _draw(Figures(staging, mine), rows, comm_rows)
        mine.add("index.json")
        (staging / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        drawn = {name for figure in index for name in figure["files"]}
        for name in mine.entries & set(WRITES) - drawn - {"index.json"}:  # an earlier plot's
            (Path(out_dir) / name).unlink(missing_ok=True)  # figures these data do not draw
        for name in [*sorted(drawn), "index.json"]:  # the index last: it describes the figures
            os.replace(staging / name, Path(out_dir) / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index


def _draw(f: Figures, rows: list[dict[str, Any]],
          comm_rows: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    ranks = "number of ranks"
    f.line("epoch_time", "Time per epoch", ranks, "time per epoch (s, log scale)",
           series_points(rows, "epoch_time_s"), logy=True)
    throughput = series_points(rows, "samples_per_s")
    multi = {k: v for k, v in throughput.items() if len(v) > 1}
    f.line("throughput", "Throughput against ideal linear scaling", ranks, "samples/s",
           throughput, ideal={k: [(n, i) for n, i, _ in scaling(v)] for k, v in multi.items()},
           from_zero=True)
    f.line("scaling_efficiency", "Scaling efficiency (throughput / ideal linear)", ranks,
           "scaling efficiency (%)",
           {k: [(n, 100 * e) for n, _, e in scaling(v)] for k, v in multi.items()}, hline=100.0)
    f.line("val_loss", "Validation loss", ranks, "validation loss (cross-entropy, nats)",
           series_points(rows, "val_loss"))
    f.line("val_acc", "Validation accuracy", ranks, "validation accuracy (%)",
           {k: [(n, 100 * a) for n, a in v] for k, v in series_points(rows, "val_acc").items()})
    f.line("peak_memory", "Peak memory per rank", ranks, "peak memory per rank (MiB)",
           {k: [(n, b / MiB) for n, b in v] for k, v in series_points(rows, "peak_memory_bytes").items()},
           from_zero=True)
    f.line("state_bytes", "Parameters + gradients + optimizer state per rank", ranks,
           "state per rank (MiB)",
           {k: [(n, b / MiB) for n, b in v] for k, v in series_points(rows, "state_bytes").items()},
           from_zero=True)
    f.line("comm_share", "Exposed communication share of step time", ranks,
           "communication share of step time (%)",
           {k: [(n, 100 * c) for n, c in v] for k, v in series_points(rows, "comm_share").items()})
    if comm_rows:
        plot_busbw(f, comm_rows)
    return f.index


def plot_busbw(f: Figures, comm_rows: list[dict[str, Any]]) -> None:
    """Bus bandwidth vs message size, one line per collective (and rank count)."""
    data = points(comm_rows, "size_bytes", "busbw_gbps", lambda r: str(r.get("op", "collective"))
                  + (f" x{r['world_size']}" if r.get("world_size") else ""))
    if not data:
        raise DtlabError("the collective results have no size_bytes/busbw_gbps columns; fix: pass "
                         "a CSV written by `dtlab comm --csv`")
    fig, ax = f.plt.subplots(figsize=(6.4, 4.2))
    for label, pts in data.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    ax.set_xscale("log", base=2)
    ax.set(title="Bus bandwidth by message size", xlabel="message size (bytes, log scale)",
           ylabel="bus bandwidth (GB/s)")
    ax.legend(fontsize="small")
    f.save(fig, "busbw", "Bus bandwidth by message size", "message size (bytes, log scale)",
           "bus bandwidth (GB/s)", list(data))
