"""What an earlier dtlab, or an earlier base config, made is found again or refused, never run
again beside itself or mixed into new results: a checkpoint whose saved config lacks keys dtlab
added since resumes; a sweep finds its finished runs under the names an earlier dtlab gave them,
and refuses runs its base config no longer makes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import CONFIGS, dtlab, fast_launches
from test_bad_inputs import refused

QUICK = ["train.max_steps=2", "run.progress=false", "run.save_model=false"]


def test_a_checkpoint_saved_before_keys_were_added_resumes(tmp_path: Path) -> None:
    proc = dtlab("train", *QUICK, "train.checkpoint_every=1", "run.dir=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = tmp_path / "r/checkpoints/step_000002/dtlab-checkpoint.json"
    saved = json.loads(manifest.read_text())
    del saved["config"]["parallel"]  # as dtlab wrote it before parallel.* existed
    del saved["config"]["strategy"]["pp"]["tp"]
    manifest.write_text(json.dumps(saved))
    proc = dtlab("train", *QUICK[1:], "train.max_steps=3", "train.checkpoint_every=1",
                 "run.dir=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from r/checkpoints/step_000002 at step 2" in proc.stderr


SPEC = "base: {base}\noverrides: {{train.max_steps: 2}}\nmatrix:\n  train.lr: [0.05]\n"


def sweep(workspace: Path) -> tuple[int, str, str]:
    with fast_launches():
        proc = dtlab("sweep", "s.yaml", "--out", "S", cwd=workspace)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_sweep_finds_its_runs_under_an_earlier_dtlabs_names(tmp_path: Path) -> None:
    shutil.copy(CONFIGS / "quick.yaml", tmp_path / "q.yaml")
    (tmp_path / "s.yaml").write_text(SPEC.format(base="q.yaml"))
    code, out, err = sweep(tmp_path)
    assert code == 0, err[-2000:]
    (run,) = (tmp_path / "S/runs").iterdir()
    run.rename(run.with_name("0123456789ab"))  # the key an earlier dtlab's config hashed to
    code, out, err = sweep(tmp_path)
    assert code == 0, err[-2000:]
    assert "1 already done, 0 to run" in out
    assert [p.name for p in (tmp_path / "S/runs").iterdir()] == ["0123456789ab"]


def test_a_sweep_refuses_runs_its_edited_base_no_longer_makes(tmp_path: Path) -> None:
    shutil.copy(CONFIGS / "quick.yaml", tmp_path / "q.yaml")
    (tmp_path / "s.yaml").write_text(SPEC.format(base="q.yaml"))
    code, out, err = sweep(tmp_path)
    assert code == 0, err[-2000:]
    (run,) = (tmp_path / "S/runs").iterdir()
    base = tmp_path / "q.yaml"
    base.write_text(base.read_text().replace("hidden: 64", "hidden: 32"))
    line = refused(["sweep", "s.yaml", "--out", "S"], tmp_path)
    assert line == (f"dtlab: error: S holds runs/{run.name}, which no combination of this sweep "
                    "makes now (its base config, or a default of dtlab, changed since it): the "
                    "results would mix it with the new runs; fix: --out a new directory, or move "
                    "it away")
