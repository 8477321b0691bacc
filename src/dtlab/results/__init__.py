"""From runs to answers: collect (CSV), plot (PNG/SVG), report (one HTML file).

Under the commands, over the loop: reads what runs wrote; may import the loop's parts and every
layer below (it uses config, the ground); never a command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dtlab.results.collect import collect, read_csv, write_csv
from dtlab.results.outputs import check_replaceable
from dtlab.results.plot import claim_plots, plot_results
from dtlab.results.report import skipped_combinations, write_report

__all__ = ["check_outputs", "collect", "plot_results", "read_csv", "write_csv", "write_outputs",
           "write_report"]


def check_outputs(root: Path, report: Path | None = None,
                  fix: str = "pass -o with another file name") -> None:
    """Refuse, writing nothing, what write_outputs would replace of the user's: a results.csv or
    report.html that dtlab did not write, a file in plots/ of a name plot writes and did not
    write there (dtlab.owned: plots/ keeps its own record, the directory above is not claimed)."""
    root = Path(root)
    check_replaceable(root / "results.csv", "csv", fix)
    check_replaceable(report or root / "report.html", "report", fix)
    if importlib.util.find_spec("matplotlib") is not None:  # else no plots are drawn
        claim_plots(root / "plots", "the report's plots directory", elsewhere="")


def write_outputs(root: Path, report: Path | None = None, comm_csvs: tuple[Path, ...] = ()) -> Path:
    """results.csv, plots/ and report.html for the runs under `root`; prints where they are."""
    root = Path(root)
    rows = collect(root)
    comm = [r for path in comm_csvs for r in read_csv(path)]  # before anything is written
    skipped_combinations(root)  # a damaged sweep.json stops here, before anything is written
    check_outputs(root, report)
    for r in rows:  # the report's findings say it too, and do not compare their throughput
        if r.get("unreliable"):
            print(f"WARN: {r['series']} at {r['world_size']} rank(s) ({r['source']}): timings "
                  f"unreliable ({r['unreliable']})", file=sys.stderr)
    csv_path = write_csv(rows, root / "results.csv")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"results: {csv_path}\nplots and report skipped: they need matplotlib "
              "(pip install 'dtlab[plot]')")
        return csv_path
    figures = plot_results(rows, root / "plots", comm)
    html = write_report(root, report or root / "report.html", rows, figures, root / "plots")
    print(f"results: {csv_path}\nplots:   {root / 'plots'} ({len(figures)} figures, PNG + SVG)\n"
          f"report:  {html}")
    return html
