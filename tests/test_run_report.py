"""`dtlab report RUN_DIR`: one run's report.html, from a real 2-rank run and from run directories
written by hand (a profiler window, an interrupted run, mistakes)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import dtlab, train

MiB = 1024 * 1024
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """2 ranks of ddp, 6 steps, with the compute/communication breakdown (a few seconds)."""
    run = tmp_path_factory.mktemp("run-report") / "ddp2"
    summary = train(run, "strategy.name=ddp", "train.max_steps=6", "run.comm_breakdown=true",
                    "run.save_model=true", nproc=2)
    return run, summary


def report(*args: str) -> str:
    proc = dtlab("report", *args)
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.stdout.strip().removeprefix("report: "))
    assert proc.stdout.startswith("report: ") and out.is_file(), proc.stdout
    return out.read_text()


def images(html: str) -> list[bytes]:
    """Every <img> decoded; each must be an embedded PNG."""
    srcs = re.findall(r"<img[^>]*\ssrc='([^']*)'", html)
    assert len(srcs) == html.count("<img")
    out = []
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:40]
        data = base64.b64decode(src.removeprefix("data:image/png;base64,"), validate=True)
        assert data.startswith(PNG) and len(data) > 5000
        out.append(data)
    return out


def links(html: str, report: Path) -> dict[str, Path]:
    """{shown name: the file its href points at, resolved from the report's directory}."""
    found = re.findall(r"<a href='([^']*)'>([^<]*)</a>", html)
    for href, _ in found:
        assert not re.match(r"[a-z]+:|/", href), href  # relative: works in a copied run dir
    return {name: (report.parent / unquote(href)).resolve() for href, name in found}


def test_report_of_a_real_run(ddp_run: tuple[Path, dict]) -> None:
    run, s = ddp_run
    html = report(str(run))
    assert "<title>dtlab run report: ddp2</title>" in html and "<script" not in html
    assert "<th>strategy</th><td>ddp</td>" in html and "<th>world_size</th><td>2</td>" in html
    assert f"<th>final_train_loss</th><td>{s['final_train_loss']:.4f}</td>" in html
    assert f"<th>samples/s</th><td>{s['samples_per_s']:,.1f}</td>" in html
    if s["mfu"] is None:  # withheld (a loaded machine): the report says why, no number
        assert "<p>MFU not reported: withheld: " in html
    else:
        assert f"<th>MFU</th><td>{s['mfu']:.1%}</td>" in html and s["mfu_note"] in html
    mem = s["memory_per_rank"]
    assert "<tr><th>rank</th>" + "".join(f"<th>{k.removesuffix('_bytes')} (MiB)</th>"
                                         for k in mem) + "</tr>" in html
    for rank in range(2):
        row = "".join(f"<td>{v[rank] / MiB:.2f}</td>" for v in mem.values())
        assert f"<tr><td class='text'>{rank}</td>{row}</tr>" in html
    c = s["comm_breakdown"]
    ratio = c["traffic_bytes_per_step"] / c["analytic_traffic_bytes_per_step"]
    assert f"measured/analytic = {ratio:.2f}" in html
    assert f"<th>exposed comm (ms)</th><td>{c['exposed_comm_s'] * 1000:.3f}</td>" in html
    assert "<td class='text'>all_reduce</td>" in html
    assert "profiler window: not recorded in this run (" in html
    files = links(html, run / "report.html")
    assert {"model.safetensors", "metrics.jsonl", "summary.json", "config.yaml"} <= set(files)
    assert all(path.is_file() for path in files.values())
    assert files["model.safetensors"] == (run / "model.safetensors").resolve()
    config = (run / "config.yaml").read_text()
    assert "strategy:\n  name: ddp" in config
    assert f"<pre>{config}</pre>" in html  # it has nothing to escape
    assert len(images(html)) == 2  # curves, memory


def test_profile_window_files_and_warnings(ddp_run: tuple[Path, dict], tmp_path: Path) -> None:
    """A summary with the profiler window's entry (its schema, written by hand), the files other
    features leave, unreliable timings, no MFU, no analytic traffic; the report written
    elsewhere with -o."""
    run = tmp_path / "run"
    shutil.copytree(ddp_run[0], run, ignore=shutil.ignore_patterns("report.html"))
    s = json.loads((run / "summary.json").read_text())
    table = [{"step": step, "step_s": 0.010 + step / 1000, "data_s": 0.001, "compute_s": 0.006,
              "optimizer_s": 0.0015, "comm_s": 0.002, "exposed_comm_s": 0.0012,
              "overlapped_comm_s": 0.0008, "other_s": 0.0003} for step in (5, 6, 7)]
    s["profile"] = {"steps": [5, 6, 7], "memory": True,
                    "traces": ["profile/trace_rank0.json", "profile/trace_rank1.json"],
                    "memory_timeline": "profile/memory_timeline_rank0.html", "table": table,
                    "median": {k: v for k, v in table[1].items() if k != "step"}}
    s["timing"]["unreliable"] = ["oversubscribed: 4 rank(s) x 1 thread(s) on 2 core(s)"]
    s["mfu"], s["mfu_note"] = None, "no peak known for <this> device; set run.peak_tflops"
    s["comm_breakdown"]["analytic_traffic_bytes_per_step"] = None
    (run / "summary.json").write_text(json.dumps(s))
    for name in ("profile/trace_rank0.json", "profile/trace_rank1.json",
                 "profile/memory_timeline_rank0.html", "memory/snapshot_rank0.pickle",
                 "flight_recorder/rank1.json", "checkpoints/step_000002/dtlab-checkpoint.json",
                 "checkpoints/step_000004/dtlab-checkpoint.json", "checkpoints/step_000006/x"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("{}")
    out = tmp_path / "reports" / "r.html"
    html = report(str(run), "-o", str(out))
    assert not (run / "report.html").exists()
    assert "<tr><td class='text'>6</td><td>16.000</td><td>1.000</td><td>6.000</td><td>1.500</td>" \
        "<td>2.000</td><td>1.200</td><td>0.800</td><td>0.300</td></tr>" in html
    assert "<tr><td class='text'>5</td><td>15.000</td>" in html
    assert "<tr><td class='text'>median</td><td>16.000</td>" in html
    assert "Profiled steps 5, 6, 7" in html
    assert len(images(html)) == 3  # curves, memory, median step
    assert html.index("Timings unreliable") < html.index("<h2>Curves")
    assert "oversubscribed: 4 rank(s) x 1 thread(s) on 2 core(s)" in html
    assert "MFU not reported: no peak known for &lt;this&gt; device; set run.peak_tflops." in html
    assert "no analytic model for this strategy" in html and "measured/analytic" not in html
    files = links(html, out)
    assert all(path.is_file() or path.is_dir() for path in files.values())
    assert files["checkpoints/step_000004"] == (run / "checkpoints/step_000004").resolve()
    assert not any("step_000006" in name or "step_000002" in name for name in files)
    assert {"profile/trace_rank0.json", "profile/trace_rank1.json",
            "profile/memory_timeline_rank0.html", "memory/snapshot_rank0.pickle",
            "flight_recorder/rank1.json"} <= set(files)
    assert "trace_rank1.json</a>: open in https://ui.perfetto.dev" in html
    assert "snapshot_rank0.pickle</a>: PyTorch memory snapshot: drag into " \
        "https://pytorch.org/memory_viz" in html
    assert "rank1.json</a>: read with `dtlab doctor hang RUN_DIR`" in html


def test_interrupted_run_without_summary(tmp_path: Path) -> None:
    run = tmp_path / "stopped"
    run.mkdir()
    rows = [{"step": k, "epoch": 0, "loss": 2.3 - k / 100, "lr": 0.05, "step_time_s": 0.01,
             "samples_per_s": 6400.0 + k, "tokens_per_s": 409600.0 + k} for k in range(1, 5)]
    rows.insert(2, {"step": 2, "val_loss": 2.25, "val_acc": 0.2})
    partial = '{"step": 5, "lo'  # killed while writing the line
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + partial)
    (run / "run.json").write_text(json.dumps({
        "status": "interrupted", "returncode": 130,
        "reason": "interrupted by SIGINT at step 4; no checkpoint <yet>"}))
    (run / "config.yaml").write_text("strategy:\n  name: fsdp\nmodel:\n  name: gpt\n")
    html = report(str(run))
    assert ("<div class='warn'><b>run interrupted</b>: interrupted by SIGINT at step 4; no "
            "checkpoint &lt;yet&gt; (exit code 130)</div>") in html
    assert "<th>strategy</th><td>fsdp</td>" in html and "<th>model</th><td>gpt</td>" in html
    assert "<th>steps</th><td>4</td>" in html and "<th>final_train_loss</th><td>2.2600</td>" in html
    assert "1 unreadable line(s) of metrics.jsonl skipped" in html
    assert "median of the logged samples/s: 6,402.5" in html
    assert "memory per rank: not recorded in this run (" in html
    assert "communication breakdown: not recorded in this run (" in html
    assert len(images(html)) == 1


def test_a_failed_run_says_why_each_rank_stopped(tmp_path: Path) -> None:
    """A run that failed writes no run.json: its ranks' flight-recorder dumps say why."""
    run = tmp_path / "hung"
    (run / "flight_recorder").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 2.3, "lr": 0.05}) + "\n")
    for rank, reason in ((0, "a collective failed at step 5 on rank 0"),
                         (1, "interrupted by SIGTERM during step 5")):
        (run / "flight_recorder" / f"rank{rank}.json").write_text(json.dumps(
            {"entries": [], "dtlab": {"rank": rank, "world_size": 2, "reason": reason}}))
    html = report(str(run))
    assert ("<div class='warn'><b>run stopped</b>: rank 0: a collective failed at step 5 on rank "
            "0 | rank 1: interrupted by SIGTERM during step 5; `dtlab doctor hang RUN_DIR` reads "
            "the dumps</div>") in html


def test_mistakes_are_one_line(ddp_run: tuple[Path, dict], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: str) -> str:
        proc = dtlab("report", *args)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("dtlab: error: ") and "; fix: " in proc.stderr
        return proc.stderr

    (tmp_path / "empty").mkdir()
    assert "holds no dtlab runs" in refused(str(tmp_path / "empty"))
    assert "not found" in refused(str(tmp_path / "absent"))
    run = ddp_run[0]
    assert "drop --comm" in refused(str(run), "--comm", str(run / "summary.json"))
    assert "is a directory" in refused(str(run), "-o", str(tmp_path))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "summary.json").write_text("{not json")
    assert "summary.json' is not a dtlab JSON record" in refused(str(damaged))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were absent
    assert "pip install 'dtlab[plot]'" in refused(str(run), "-o", str(tmp_path / "r.html"))
    assert not (tmp_path / "r.html").exists()
