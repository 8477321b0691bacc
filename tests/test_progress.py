"""The progress bar shows the loss of the last logged step, never nan, and the metric lines stay."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import dtlab

from dtlab.instruments.metrics import MetricsLog


def test_the_bar_shows_the_last_logged_loss(tmp_path: Path, capsys) -> None:
    log = MetricsLog(tmp_path, True, total_steps=10, progress=True)
    shown = []
    for step in range(1, 11):
        if step % 4 == 0 or step == 10:
            log.log({"step": step, "loss": 1 / step})
        log.advance(step)
        shown.append(log.bar.postfix)
    log.close()
    assert shown[:3] == [None] * 3  # nothing logged yet: no loss, not nan
    assert shown[3:7] == ["loss=0.2500"] * 4 and shown[7:9] == ["loss=0.1250"] * 2
    assert shown[9] == "loss=0.1000"
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines()] == ["step=4", "step=8", "step=10"]
    assert "nan" not in err and "loss=0.1000" in err


def test_a_run_with_a_bar_logs_its_metrics_and_no_nan(tmp_path: Path) -> None:
    proc = dtlab("train", "train.max_steps=5", "run.log_every=2", "run.progress=true",
                 "train.global_batch_size=16", "data.val_limit=64", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert [line.split()[1] for line in proc.stdout.splitlines()
            if line.startswith("[METRIC] step=") and " loss=" in line] == ["step=2", "step=4", "step=5"]
    assert "nan" not in proc.stderr and f"loss={losses[-1]:.4f}" in proc.stderr
