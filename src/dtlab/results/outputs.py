"""What `collect` and `report` write: whole or absent (dtlab.atomic_write), and only over a file
that is an earlier output of the same kind. `-o` names any path, and a run directory holds
files nothing else can restore (summary.json, metrics.jsonl): `dtlab report RUN -o
RUN/summary.json` must not turn a run's record into HTML."""

from __future__ import annotations

from pathlib import Path

from dtlab import atomic_write, files, owned

# kind -> (what the file is called in messages, a test on its first bytes)
KINDS = {
    "report": ("an HTML report dtlab wrote", files.report_head),
    "csv": ("a results CSV dtlab wrote", lambda head: head.startswith(b"series,strategy,")),
}


def check_replaceable(path: Path, kind: str, fix: str = "pass -o with another file name") -> None:
    """Refuse to replace a file that is not an earlier output of `kind`."""
    what, looks_right = KINDS[kind]
    atomic_write.check_replaceable(path, what, looks_right, fix)


def write_output(path: Path, text: str, kind: str) -> Path:
    """`text` to `path`, whole or not at all, after check_replaceable."""
    check_replaceable(path, kind)
    return atomic_write.write_atomic(Path(path), lambda draft: draft.write_text(text, newline=""),
                        f"writing '{path}'", "-o/--output")


def report_outputs(directory: Path) -> list[str]:
    """What `dtlab report` wrote in a directory: report.html, results.csv and plots/, each only
    where dtlab wrote it."""
    directory, found = Path(directory), []
    for name, kind in (("report.html", "report"), ("results.csv", "csv")):
        path = directory / name
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                if KINDS[kind][1](f.read(4096)):
                    found.append(name)
    plots = directory / "plots"
    if plots.is_dir() and not plots.is_symlink() and (owned.read(plots) or {}).get("kind") == "plot":
        found.append("plots/")
    return found
