"""Experiment trackers (run.trackers): MLflow, Weights & Biases (offline) and TensorBoard get the
resolved config, every logged step's metrics, the evaluations, the summary and the run's files,
from rank 0 only; a missing extra is one line; a tracker failing mid-run does not stop training.

Runs are tiny (4 steps of the quick CNN) and, but for the 2-rank one, in this process, so that
MLflow is imported once (about 3 s).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab, train
from test_bad_inputs import refused

QUICK = str(CONFIGS / "quick.yaml")
TINY = ("train.max_steps=4", "train.eval_every=2", "data.synthetic.train_samples=256",
        "data.synthetic.val_samples=64")


@pytest.fixture(autouse=True)
def _no_tracker_setup_of_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults under test, whatever this machine's user has set up."""
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store with its tables made: MLflow takes ~4 s of CPU to set up a new one
    (its schema migrations), so each test starts from a copy of this one."""
    store = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow_client(store).search_experiments()
    return store


def store_in(directory: Path, empty: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty, directory / "mlflow.db")
    return directory / "mlflow.db"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in metrics.jsonl: what every tracker must have too."""
    return [(r["step"], r[key]) for r in records(run_dir) if key in r]


def mlflow_client(store: Path):  # noqa: ANN201 - mlflow is optional
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{store}")


def mlflow_runs(store: Path, experiment: str = "dtlab") -> list:
    client = mlflow_client(store)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment} in {store}"
    return client.search_runs([found.experiment_id])


def metric_history(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in mlflow_client(store).get_metric_history(run_id, key)]


def test_mlflow_logs_params_every_step_evaluations_summary_and_artifacts(
        tmp_path: Path, empty_store: Path) -> None:
    """MLflow (a sqlite store in the run directory) holds the config as parameters, every logged step's loss, the evaluations, the summary and summary.json as an artifact."""
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    store_in(run_dir, empty_store)  # where it goes by default
    summary = train(run_dir, *TINY, "run.trackers=[mlflow]", "train.lr=0.07", config=QUICK)
    (run,) = mlflow_runs(run_dir / "mlflow.db")
    store = run_dir / "mlflow.db"
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["train.lr"] == "0.07" and params["run.trackers"] == '["mlflow"]'
    assert params["model.channels"] == "[16, 32]" and params["strategy.name"] == "single"
    assert len(history(run_dir, "loss")) == 4  # run.log_every=1
    for key in ("loss", "lr", "val_loss", "val_acc"):
        logged = metric_history(store, run.info.run_id, key)
        assert sorted(logged) == pytest.approx(history(run_dir, key), rel=1e-6), key
    assert run.data.metrics["summary.samples_per_s"] == pytest.approx(summary["samples_per_s"])
    assert run.data.tags["summary.strategy"] == "single"
    client = mlflow_client(store)
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "metrics.jsonl"} <= names
    got = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(got.read_text()) == summary
    assert json.loads((run_dir / "trackers.json").read_text()) == {"mlflow": run.info.run_id}


def test_two_ranks_log_one_mlflow_run_from_rank_0(tmp_path: Path, empty_store: Path) -> None:
    """A 2-rank ddp run logs one MLflow run (rank 0's), whose loss history is metrics.jsonl's."""
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    store_in(run_dir, empty_store)
    train(run_dir, *TINY, "strategy.name=ddp", "run.trackers=[mlflow]", nproc=2, config=QUICK)
    (run,) = mlflow_runs(run_dir / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["strategy.name"] == "ddp"
    assert metric_history(run_dir / "mlflow.db", run.info.run_id, "loss") == \
        pytest.approx(history(run_dir, "loss"), rel=1e-6)


def test_sweep_runs_share_one_mlflow_experiment_and_wandb_group(tmp_path: Path,
                                                               empty_store: Path) -> None:
    """A sweep's runs go to one MLflow experiment named after the sweep (in OUT/mlflow.db), each run named by what varies, and to one wandb group."""
    pytest.importorskip("mlflow")
    from dtlab.config import to_yaml
    from dtlab.sweeps.spec import expand, load_spec

    spec = tmp_path / "lr.yaml"
    spec.write_text(f"base: {CONFIGS / 'quick.yaml'}\noverrides: {{train.max_steps: 2, "
                    "data.synthetic.train_samples: 128, data.synthetic.val_samples: 64, "
                    "run.trackers: [mlflow]}\nmatrix: {train.lr: [0.05, 0.1]}\n")
    out = tmp_path / "study"
    store_in(out, empty_store)
    plans = expand(load_spec(spec), out, "local")
    assert {p.config.run.wandb.group for p in plans} == {"study"}
    for p in plans:  # each planned run as the sweep starts it, here in this process
        p.run_dir.mkdir(parents=True)
        (p.run_dir / "config.yaml").write_text(to_yaml(p.config))
        assert dtlab("train", "--config", str(p.run_dir / "config.yaml")).returncode == 0
    runs = mlflow_runs(out / "mlflow.db", "study")
    assert sorted(r.info.run_name for r in runs) == ["train.lr=0.05", "train.lr=0.1"]
    assert sorted(r.data.params["train.lr"] for r in runs) == ["0.05", "0.1"]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_wandb_offline_writes_its_run_directory(tmp_path: Path) -> None:
    """wandb (offline by default, no network) writes its run under RUN_DIR/wandb/ with every logged loss, the config and the run's files as an artifact."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    train(run_dir, *TINY, "run.trackers=[wandb]", "run.wandb.project=trk", config=QUICK)
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    data = (offline / f"run-{run_id}.wandb").read_bytes()  # the records, synced by `wandb sync`
    for step, loss in history(run_dir, "loss") + history(run_dir, "val_loss"):
        assert json.dumps(loss).encode() in data, f"step {step}'s loss {loss} is not in the run"
    assert b"train.max_steps" in data and f"run-{run_id}-files".encode() in data


def test_tensorboard_keeps_working_as_run_tensorboard_true(tmp_path: Path) -> None:
    """run.tensorboard=true (the same as run.trackers=[tensorboard]) writes every logged step's loss to RUN_DIR/tb."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    train(run_dir, *TINY, "run.tensorboard=true", config=QUICK)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert logged == pytest.approx(history(run_dir, "loss"), rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [2, 4]


MISSING = [
    ("mlflow", "run.trackers=[mlflow]",
     "run.trackers includes mlflow, which needs the mlflow package; fix: pip install 'dtlab[mlflow]'"),
    ("wandb", "run.trackers=[tensorboard,wandb]",
     "run.trackers includes wandb, which needs the wandb package; fix: pip install 'dtlab[wandb]'"),
    ("tensorboard", "run.trackers=[tensorboard]", "run.trackers includes tensorboard, which needs "
     "the tensorboard package; fix: pip install 'dtlab[tensorboard]'"),
    ("tensorboard", "run.tensorboard=true", "run.tensorboard=true needs the tensorboard package; "
     "fix: pip install 'dtlab[tensorboard]'"),
]


@pytest.mark.parametrize(("package", "setting", "expected"), MISSING,
                         ids=[m[1] for m in MISSING])
def test_missing_tracker_package_is_one_line(package: str, setting: str, expected: str,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker whose package is not installed is refused in one line naming its extra, before any rank starts."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    line = refused(["train", setting, f"run.dir={tmp_path}/run"], tmp_path)
    assert line.startswith(f"dtlab: error: {expected}"), line
    assert not (tmp_path / "run").exists()


def test_tracker_failing_mid_run_warns_once_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_store: Path) -> None:
    """A tracker that fails mid-run (its server gone) prints one warning line and is dropped; the run finishes with all its metrics and summary."""
    pytest.importorskip("mlflow")
    from dtlab.instruments.trackers.mlflow import MlflowTracker

    real = MlflowTracker.metrics

    def gone_after_step_2(self: MlflowTracker, values: dict, step: int) -> None:
        if step > 2:
            raise ConnectionError("API request to http://mlflow:5000 failed: Connection refused")
        real(self, values, step)

    monkeypatch.setattr(MlflowTracker, "metrics", gone_after_step_2)
    run_dir = tmp_path / "run"
    store_in(run_dir, empty_store)
    proc = dtlab("train", "--config", QUICK, *TINY, "run.trackers=[mlflow]", f"run.dir={run_dir}", "run.log_every=1",
                 "run.progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == ["dtlab: warning: tracker mlflow failed logging metrics at step 3 (API "
                        "request to http://mlflow:5000 failed: Connection refused); the run goes on "
                        "without it (metrics.jsonl and summary.json have everything)"], proc.stderr
    assert [s for s, _ in history(run_dir, "loss")] == [1, 2, 3, 4]
    assert (run_dir / "summary.json").is_file()
    (run,) = mlflow_runs(run_dir / "mlflow.db")
    assert [s for s, _ in metric_history(run_dir / "mlflow.db", run.info.run_id, "loss")] == [1, 2]
    assert run.info.status == "FAILED"  # what it holds is not the whole run


@pytest.mark.parametrize("where", ["run.mlflow.tracking_uri", "MLFLOW_TRACKING_URI"])
def test_tracker_that_cannot_start_stops_the_run_in_one_line(where: str, tmp_path: Path) -> None:
    """A tracker that cannot start (an MLflow store address, in the config or MLflow's variable, that no store answers) stops the run before it writes anything, in one line."""
    pytest.importorskip("mlflow")
    setting = ["run.mlflow.tracking_uri=nowhere://x"] if where.startswith("run.") else []
    proc = dtlab("train", "--config", QUICK, *TINY, "run.trackers=[mlflow]", *setting,
                 f"run.dir={tmp_path / 'run'}", "run.progress=false",
                 env={} if setting else {"MLFLOW_TRACKING_URI": "nowhere://x"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("dtlab: error: tracker mlflow could not start (")
    assert "fix: check run.mlflow and MLFLOW_TRACKING_URI" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written: run again once it is fixed



def test_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path: Path, empty_store: Path) -> None:
    """A resumed run goes on in the MLflow run it began (one run, the loss of every step, finished), its id kept in RUN_DIR/trackers.json."""
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    store = store_in(run_dir, empty_store)
    train(run_dir, *TINY, "train.max_steps=2", "train.checkpoint_every=2", "run.trackers=[mlflow]",
          config=QUICK)
    train(run_dir, *TINY, "train.checkpoint_every=2", "run.trackers=[mlflow]", config=QUICK)
    (run,) = mlflow_runs(store)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in metric_history(store, run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert run.data.params["train.max_steps"] == "2"  # MLflow keeps a parameter's first value


def test_sweep_without_a_tracker_package_is_one_line(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep whose runs list a tracker that is not installed is refused in one line before any run starts."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"base: {QUICK}\noverrides: {{run.trackers: [wandb]}}\n"
                    "matrix: {train.lr: [0.05, 0.1]}\n")
    line = refused(["sweep", str(spec), "--out", str(tmp_path / "out")], tmp_path)
    assert "run.trackers includes wandb, which needs the wandb package" in line
