"""collect, plot, findings and report, on runs and logs with known numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import dtlab, train

from dtlab.cli.main import main
from dtlab.results import collect, plot_results, read_csv, write_csv, write_report
from dtlab.results.findings import findings

MiB = 1024 * 1024


def fake_run(root: Path, name: str, strategy: str, world: int, sps: float, param: int,
             val_acc: float = 0.5, options: dict | None = None,
             unreliable: list[str] | None = None) -> None:
    run = root / name
    run.mkdir(parents=True)
    summary = {
        "strategy": strategy, "strategy_options": options or {}, "world_size": world, "nnodes": 1,
        "samples_per_s": sps, "median_step_time_s": 64 / sps, "epoch_time_s": 64 * 10 / sps,
        "val_loss": 1.0, "val_acc": val_acc, "final_train_loss": 1.1, "device": "cpu",
        "backend": "gloo", "torch_version": "2.13.0", "hostname": "node1", "threads_per_rank": 1,
        "memory_per_rank": {"peak_rss_bytes": [400 * MiB] * world, "param_bytes": [param] * world,
                            "grad_bytes": [param] * world, "optim_bytes": [param] * world},
        "timing": {"cores": 2, "unreliable": unreliable or []},
    }
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    fake_run(root, "ddp1", "ddp", 1, 1000.0, 4 * MiB)
    fake_run(root, "ddp2", "ddp", 2, 1800.0, 4 * MiB)
    fake_run(root, "fsdp2", "fsdp", 2, 1584.0, 2 * MiB)
    fake_run(root, "sgo2", "fsdp1", 2, 1700.0, 2 * MiB, options={"sharding_strategy": "SHARD_GRAD_OP"})
    (root / "other").mkdir()
    (root / "other" / "job.out").write_text(
        "starting\n[METRIC] strategy=handwritten world_size=2 samples_per_s=900\n"
        "noise line\n[METRIC] val_acc=0.75 samples_per_s=950.5\n")
    return root


def test_collect_reads_summaries_and_metric_lines(runs: Path, tmp_path: Path) -> None:
    rows = collect(runs)
    by = {r["source"]: r for r in rows}
    assert by["ddp2"]["series"] == "ddp" and by["ddp2"]["state_bytes"] == 12 * MiB
    assert by["sgo2"]["series"] == "fsdp1:SHARD_GRAD_OP"
    log = by["other/job.out"]
    assert log["series"] == "handwritten" and log["samples_per_s"] == 950.5 and log["val_acc"] == 0.75
    path = write_csv(rows, tmp_path / "results.csv")
    again = read_csv(path)
    assert len(again) == 5 and {r["world_size"] for r in again} == {1, 2}
    assert main(["collect", str(tmp_path / "absent"), "-o", str(tmp_path / "x.csv")]) == 2


def test_findings_name_ratios_and_scaling(runs: Path) -> None:
    text = findings(collect(runs))
    assert ("fsdp holds 50% of ddp's parameter bytes per rank and 50% of ddp's training state "
            "per rank at 2 ranks; throughput -12%.") in text
    assert "ddp: 1 -> 2 ranks, throughput x1.80 (scaling efficiency 90%)." in text
    assert ("At 2 ranks the fastest is ddp (1,800 samples/s), the leanest fsdp and "
            "fsdp1:SHARD_GRAD_OP (6.00 MiB of state per rank).") in text
    assert any(s.startswith("On CPU at 2 ranks, peak RSS does not show sharding") for s in text)


def test_findings_report_compare_verification(runs: Path) -> None:
    (runs / "compare.json").write_text(json.dumps([
        {"strategy": "ddp", "loss_dev": "2.00e-07", "param_dev": "3.00e-07"},
        {"strategy": "fsdp", "loss_dev": "4.00e-07", "param_dev": "1.00e-07"}]))
    rows = collect(runs)
    assert {r["series"]: r.get("loss_dev") for r in rows}["fsdp"] == 4e-7
    assert ("ddp, fsdp train the same function as single: per-step losses within 4.0e-07 and "
            "final parameters within 3.0e-07 (relative, dtlab compare --verify).") in findings(rows)


def test_plots_have_their_labels_and_series(runs: Path, tmp_path: Path) -> None:
    comm = tmp_path / "comm.csv"
    comm.write_text("op,world_size,size_bytes,busbw_gbps\n" + "\n".join(
        f"all_reduce,2,{2 ** k},{0.1 * k}" for k in range(3, 20)) + "\n")
    figures = plot_results(collect(runs), tmp_path / "plots", read_csv(comm))
    by = {f["name"]: f for f in figures}
    assert set(by) == {"epoch_time", "throughput", "scaling_efficiency", "val_loss", "val_acc",
                       "peak_memory", "state_bytes", "busbw"}  # no comm_share column: no figure
    assert by["throughput"]["series"] == ["ddp", "fsdp", "fsdp1:SHARD_GRAD_OP", "handwritten"]
    assert by["busbw"]["series"] == ["all_reduce x2"]
    for fig in figures:
        svg = (tmp_path / "plots" / f"{fig['name']}.svg").read_text()
        assert fig["xlabel"] in svg and fig["ylabel"] in svg and fig["title"] in svg
        for label in fig["series"]:
            assert label in svg, (fig["name"], label)
        assert (tmp_path / "plots" / f"{fig['name']}.png").stat().st_size > 5000
    throughput = (tmp_path / "plots" / "throughput.svg").read_text()
    assert "ddp (ideal linear)" in throughput  # only series with several rank counts
    assert "fsdp (ideal linear)" not in throughput
    # The efficiency curve: ddp 1800 / (2 x 1000) = 90%.
    assert json.loads((tmp_path / "plots" / "index.json").read_text())[2]["name"] == "scaling_efficiency"


def test_plot_refuses_a_csv_without_ranks(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["plot", str(bad), "-o", str(tmp_path / "p")]) == 2
    assert "no world_size column" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "absent.csv")]) == 2


def test_report_is_self_contained(runs: Path, tmp_path: Path) -> None:
    rows = collect(runs)
    figures = plot_results(rows, tmp_path / "plots")
    html = write_report(runs, tmp_path / "report.html", rows, figures, tmp_path / "plots").read_text()
    assert html.count("<img src='data:image/png;base64,") == len(figures) == 7
    assert not re.search(r"(src|href)=['\"](?!data:)", html)  # nothing outside the file
    assert "<script" not in html
    assert "fsdp holds 50% of ddp&#x27;s parameter bytes" in html
    assert "<th>torch</th><td class='text'>2.13.0</td>" in html
    assert html.count("<tr") == 10 + 1 + 5  # environment rows, header, runs


OVERSUBSCRIBED = "oversubscribed: 4 rank(s) x 1 thread(s) on 2 core(s)"
LOADED = "machine loaded: other processes kept 1.0 of 2 core(s) busy"


@pytest.fixture()
def shaky_runs(tmp_path: Path) -> Path:
    """What the issue saw: single under load at 722 samples/s against ddp's 4,711, and 4 ranks on
    2 cores at 3% scaling efficiency."""
    root = tmp_path / "shaky"
    fake_run(root, "single1", "single", 1, 722.0, 4 * MiB, unreliable=[LOADED])
    fake_run(root, "ddp1", "ddp", 1, 4711.0, 4 * MiB)
    fake_run(root, "ddp4", "ddp", 4, 565.0, 4 * MiB, unreliable=[OVERSUBSCRIBED])
    fake_run(root, "fsdp4", "fsdp", 4, 2000.0, 1 * MiB)
    return root


def test_findings_draw_no_conclusion_from_unreliable_timings(shaky_runs: Path) -> None:
    text = findings(collect(shaky_runs))
    assert text[:2] == [
        f"WARN: ddp at 4 ranks: timings unreliable ({OVERSUBSCRIBED}); its throughput is not compared.",
        f"WARN: single at 1 rank: timings unreliable ({LOADED}); its throughput is not compared."]
    assert ("fsdp holds 25% of ddp's parameter bytes per rank and 25% of ddp's training state per "
            "rank at 4 ranks.") in text  # memory is exact under load; no throughput ratio
    assert "ddp: scaling not computed: the timings at 4 ranks are unreliable." in text
    assert ("At 1 rank no fastest is named (timings of single unreliable), the leanest ddp and "
            "single (12.00 MiB of state per rank).") in text
    assert any(s.startswith("At 4 ranks no fastest is named (timings of ddp unreliable), the "
                            "leanest fsdp") for s in text)
    assert not [s for s in text[2:] if "efficiency" in s or "the fastest is" in s or "throughput" in s]


def test_compare_warns_about_an_unreliable_run() -> None:
    from dtlab.instruments.machine_load import warning

    assert warning("ddp", {"timing": {"unreliable": [OVERSUBSCRIBED, LOADED]}}) == (
        f"WARN: ddp: timings unreliable ({OVERSUBSCRIBED}; {LOADED}); rerun on an idle machine "
        "with ranks x threads <= cores")
    assert warning("ddp", {"timing": {"unreliable": []}}) is None and warning("ddp", {}) is None


def test_unreliable_reasons() -> None:
    """judge(): oversubscription, load from others beyond the free cores, step-time spread."""
    from dtlab.instruments.machine_load import judge

    def record(cores: int, ranks: int, threads: int, others: float | None,
               load: float = 0.0) -> dict:
        node = {"cores": cores, "ranks_on_node": ranks, "busy_threads": ranks * threads,
                "others_cores": others}
        return {**node, "threads_per_rank": threads, "loadavg_before": [load] * 3, "nodes": [node]}

    assert judge(record(2, 2, 1, 0.3), 0.08, 40) == []
    assert judge(record(2, 1, 1, 1.4), 0.08, 40) == []  # the other core was free for them
    assert judge(record(2, 1, 1, 1.6), 0.08, 40) == [
        "machine loaded: other processes kept 1.6 of 2 core(s) busy"]
    assert judge(record(2, 4, 1, 0.0), 0.1, 40) == [OVERSUBSCRIBED]
    assert judge(record(2, 2, 1, 0.0), 0.6, 40) == [
        "step times spread by 60% of the median (p10 to p90, limit 50%)"]
    assert judge(record(2, 2, 1, 0.0), 0.6, 4) == []  # too few steps to judge a spread
    assert judge(record(2, 2, 1, None, load=3.2), None, 0) == [
        "machine loaded: load average 3.2 above 2 core(s)"]  # no /proc/stat: the load average


def test_report_warns_once_per_unreliable_run(shaky_runs: Path, tmp_path: Path) -> None:
    proc = dtlab("report", str(shaky_runs), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("WARN: ")] == [
        f"WARN: ddp at 4 rank(s) (ddp4): timings unreliable ({OVERSUBSCRIBED})",
        f"WARN: single at 1 rank(s) (single1): timings unreliable ({LOADED})"]
    html = (tmp_path / "r.html").read_text()
    assert "<li>WARN: single at 1 rank: timings unreliable" in html and "scaling efficiency" not in html
    assert f"<td class=\"text\">{LOADED}</td>" in html  # the run's row in the table says it too
    assert "unreliable" in (shaky_runs / "results.csv").read_text().splitlines()[0]


def test_four_ranks_on_fewer_cores_are_flagged(tmp_path: Path) -> None:
    """A real run of 4 ranks with more threads than cores (4 ranks on 2 cores here; half the
    cores per rank on larger machines): its summary says so, and the findings refuse its
    scaling."""
    import os

    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 2)
    s = train(tmp_path / "runs" / "ddp4", "strategy.name=ddp", "train.max_steps=3",
              "train.global_batch_size=16", "data.val_limit=64", f"run.threads={threads}", nproc=4)
    t = s["timing"]
    assert (t["ranks_on_node"], t["threads_per_rank"], t["busy_threads"], t["cores"]) == (
        4, threads, 4 * threads, cores)
    assert t["oversubscribed"] and t["unreliable"][0] == (
        f"oversubscribed: 4 rank(s) x {threads} thread(s) on {cores} core(s)")
    assert len(t["loadavg_before"]) == len(t["loadavg_after"]) == 3
    assert t["others_cores"] is not None and t["others_cores"] >= 0
    fake_run(tmp_path / "runs", "ddp1", "ddp", 1, 1000.0, 4 * MiB)
    text = findings(collect(tmp_path / "runs"))
    assert "ddp: scaling not computed: the timings at 4 ranks are unreliable." in text
    assert text[0].startswith("WARN: ddp at 4 ranks: timings unreliable (oversubscribed")
