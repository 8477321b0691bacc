"""report.html in a real browser: headless Chromium renders it without console errors and every
figure has a non-zero size (a sweep's report, and one run's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import dtlab

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


def render(report: Path) -> tuple[list[str], list[list], str]:
    """The console errors, the images' [natural w, natural h, rendered w, rendered h, alt] and
    the title of `report` in headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(report.as_uri(), wait_until="load")
            sizes = page.evaluate("""Array.from(document.images).map(i => {
                const r = i.getBoundingClientRect();
                return [i.naturalWidth, i.naturalHeight, r.width, r.height, i.alt]; })""")
            title = page.title()
        finally:
            browser.close()
    return problems, sizes, title


@needs_chromium
def test_report_renders_in_headless_chromium(local_sweep) -> None:
    out, _ = local_sweep
    problems, sizes, title = render(out / "report.html")
    assert problems == []
    assert len(sizes) >= 7
    for natural_w, natural_h, width, height, alt in sizes:
        assert natural_w > 0 and natural_h > 0 and width > 0 and height > 0, alt
    assert title.startswith("dtlab report")


@needs_chromium
def test_run_report_renders_in_headless_chromium(local_sweep, tmp_path: Path) -> None:
    """One of the sweep's runs (2 ranks of ddp), reported on its own, outside the sweep."""
    out, _ = local_sweep
    run = next(p.parent for p in sorted(out.rglob("summary.json"))
               if json.loads(p.read_text())["world_size"] == 2
               and json.loads(p.read_text())["strategy"] == "ddp")
    # with a profiler window's table (as run.profile writes it: tests/test_profile.py)
    run = Path(shutil.copytree(run, tmp_path / "run"))
    summary = json.loads((run / "summary.json").read_text())
    row = {"step_s": 0.02, "data_s": 0.001, "compute_s": 0.012, "optimizer_s": 0.001,
           "exposed_comm_s": 0.004, "other_s": 0.002, "comm_s": 0.005, "overlapped_comm_s": 0.001}
    summary["profile"] = {"steps": [5], "table": [{"step": 5, **row}], "median": row,
                          "traces": ["profile/trace_rank0.json", "profile/trace_rank1.json"]}
    (run / "summary.json").write_text(json.dumps(summary))
    report = tmp_path / "run.html"
    proc = dtlab("report", str(run), "-o", str(report))
    assert proc.returncode == 0, proc.stderr
    problems, sizes, title = render(report)
    assert problems == []
    assert len(sizes) == 3  # curves, memory per rank, the median step by part
    for natural_w, natural_h, width, height, alt in sizes:
        assert natural_w > 0 and natural_h > 0 and width > 0 and height > 0, alt
    assert title.startswith("dtlab run report")
