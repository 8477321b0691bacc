"""No dtlab command replaces or mixes a user's files in the directories it writes (dtlab.owned):
compare's --out, a sweep's output directory, plot's -o and the report's plots/ are refused in one
line, before anything is written, where they hold files dtlab did not write there or another
owner's output; the same command run again replaces its own output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import CONFIGS, dtlab, fast_launches
from test_bad_inputs import EARLIER_SUMMARY, refused

from dtlab.owned import RECORD

RESULTS = "series,strategy,world_size,status,samples_per_s\nddp,ddp,1,done,900.0\nddp,ddp,2,done,1800.0\n"
SPEC = f"""base: {CONFIGS / 'quick.yaml'}
overrides: {{strategy.name: single, train.max_steps: 2, run.timing_warmup_steps: 1}}
matrix: {{seed: [1]}}
"""


def users_files(root: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)


def ok(proc) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# ------------------------------------------------------------------------------ compare
def test_compare_refuses_a_users_run_in_its_out_before_any_run(tmp_path: Path) -> None:
    """A user's own training run in --out/ddp (checkpoints included) stays as it was."""
    users_files(tmp_path, {"myruns/ddp/summary.json": b'{"steps": 900}',
                           "myruns/ddp/checkpoints/step_000900/model.bin": b"\x00weights",
                           "myruns/ddp/config.yaml": b"strategy: {name: ddp}\n"})
    with fast_launches():
        line = refused(["compare", "--strategies", "single,ddp", "--nproc-per-node", "2",
                        "--out", "myruns", "train.max_steps=2"], tmp_path, quiet=True)
    assert line == ("dtlab: error: --out 'myruns' holds ddp, which dtlab compare did not write "
                    "there and would replace; fix: move it away, or choose another directory")


def test_compare_replaces_its_own_runs_and_keeps_the_users_files(tmp_path: Path) -> None:
    """compare twice into one --out, a report written there in between: the second compare is
    refused until that report is moved away (it describes the earlier runs), then trains its run
    anew; the user's notes beside the runs stay."""
    args = ["compare", "--strategies", "single", "--out", "cmp", "train.max_steps=2",
            "run.timing_warmup_steps=1"]
    with fast_launches():
        ok(dtlab(*args, cwd=tmp_path))
        (tmp_path / "cmp" / "notes.txt").write_text("mine\n")
        ok(dtlab("report", "cmp", cwd=tmp_path))  # results.csv, plots/, report.html beside
        first = (tmp_path / "cmp" / "single" / "summary.json").stat().st_mtime_ns
        assert dtlab(*args, cwd=tmp_path).returncode == 2  # that report is moved away first
        for name in ("report.html", "results.csv", "plots"):
            path = tmp_path / "cmp" / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        ok(dtlab(*args, cwd=tmp_path))
    assert (tmp_path / "cmp" / "single" / "summary.json").stat().st_mtime_ns > first
    assert (tmp_path / "cmp" / "notes.txt").read_text() == "mine\n"
    record = json.loads((tmp_path / "cmp" / RECORD).read_text())
    assert (record["kind"], record["entries"]) == ("compare", ["compare.csv", "compare.json", "single"])


# ------------------------------------------------------------------------------ sweep
def test_a_sweep_directory_belongs_to_one_spec_by_path_and_content(tmp_path: Path) -> None:
    """Two specs named sweep.yaml in two folders share the default sweeps/sweep: the second, and
    the first once edited, are refused there before any run; the first as it was continues."""
    for folder in ("a", "b"):  # the same bytes: the path alone makes them two specs
        users_files(tmp_path, {f"{folder}/sweep.yaml": SPEC.encode()})
    with fast_launches():
        ok(dtlab("sweep", "a/sweep.yaml", cwd=tmp_path))
        owner = (tmp_path / "a" / "sweep.yaml").resolve()
        line = refused(["sweep", "b/sweep.yaml"], tmp_path, quiet=True)
        assert line == (
            f"dtlab: error: the sweep's output directory 'sweeps/sweep' holds the output of dtlab "
            f"sweep ({owner}), not of this sweep ({(tmp_path / 'b' / 'sweep.yaml').resolve()}), "
            "and writing there would mix the two; fix: give this spec its own --out DIR, or "
            "delete that directory first")
        (tmp_path / "a" / "sweep.yaml").write_text(SPEC.replace("[1]", "[1, 2]"))
        line = refused(["sweep", "a/sweep.yaml"], tmp_path, quiet=True)
        assert f"({owner} as it was then), not of this sweep ({owner} as it is now)" in line
        (tmp_path / "a" / "sweep.yaml").write_text(SPEC)
        again = ok(dtlab("sweep", "a/sweep.yaml", cwd=tmp_path))
    assert "1 already done, 0 to run" in again and "1 of 1 runs done" in again


def test_a_sweep_refuses_a_users_figure_in_its_plots_before_any_run(tmp_path: Path) -> None:
    """The report a sweep writes at its end is checked at its start: no run is wasted."""
    users_files(tmp_path, {"s.yaml": SPEC.encode(), "o/plots/throughput.png": b"my figure"})
    with fast_launches():
        line = refused(["sweep", "s.yaml", "--out", "o"], tmp_path, quiet=True)
    assert line == ("dtlab: error: the report's plots directory 'o/plots' holds throughput.png, "
                    "which dtlab plot did not write there and would replace; fix: move it away")


# ------------------------------------------------------------------------------ plot, report, collect
def test_plot_refuses_a_users_figure_and_index(tmp_path: Path) -> None:
    users_files(tmp_path, {"results.csv": RESULTS.encode(), "figs/throughput.png": b"my figure",
                           "figs/index.json": b"[1, 2]"})
    line = refused(["plot", "results.csv", "-o", "figs"], tmp_path, quiet=True)
    assert line == ("dtlab: error: -o/--output 'figs' holds index.json, throughput.png, which "
                    "dtlab plot did not write there and would replace; fix: move them away, or "
                    "choose another directory")


def test_plot_replaces_its_own_figures_and_keeps_the_users(tmp_path: Path) -> None:
    users_files(tmp_path, {"results.csv": RESULTS.encode(), "figs/my_plot.png": b"my figure"})
    ok(dtlab("plot", "results.csv", "-o", "figs", cwd=tmp_path))
    first = (tmp_path / "figs" / "throughput.png").stat().st_mtime_ns
    ok(dtlab("plot", "results.csv", "-o", "figs", cwd=tmp_path))
    assert (tmp_path / "figs" / "throughput.png").stat().st_mtime_ns > first
    assert (tmp_path / "figs" / "my_plot.png").read_bytes() == b"my figure"
    entries = json.loads((tmp_path / "figs" / RECORD).read_text())["entries"]
    assert {"index.json", "throughput.png", "throughput.svg"} <= set(entries)
    assert "my_plot.png" not in entries


def test_report_refuses_a_users_figure_in_plots_and_writes_nothing(tmp_path: Path) -> None:
    users_files(tmp_path, {"runs/ddp/summary.json": json.dumps(EARLIER_SUMMARY).encode(),
                           "runs/plots/scaling_efficiency.svg": b"<svg>mine</svg>"})
    line = refused(["report", "runs"], tmp_path, quiet=True)
    assert line == ("dtlab: error: the report's plots directory 'runs/plots' holds "
                    "scaling_efficiency.svg, which dtlab plot did not write there and would "
                    "replace; fix: move it away")


def test_collect_refuses_to_replace_a_users_file(tmp_path: Path) -> None:
    users_files(tmp_path, {"runs/ddp/summary.json": json.dumps(EARLIER_SUMMARY).encode(),
                           "mine.csv": b"name,score\nme,1\n"})
    line = refused(["collect", "runs", "-o", "mine.csv"], tmp_path, quiet=True)
    assert "'mine.csv' exists and is not a results CSV dtlab wrote" in line
