"""report.html in a real browser: headless Chromium renders it without console errors and every
figure has a non-zero size."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(local_sweep) -> None:
    from playwright.sync_api import sync_playwright

    out, _ = local_sweep
    report = out / "report.html"
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
    assert problems == []
    assert len(sizes) >= 7
    for natural_w, natural_h, width, height, alt in sizes:
        assert natural_w > 0 and natural_h > 0 and width > 0 and height > 0, alt
    assert title.startswith("dtlab report")
