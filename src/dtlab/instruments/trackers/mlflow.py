"""run.trackers=[mlflow]: one MLflow run per dtlab run, through MlflowClient (no global active
run: a failed run in this process leaves nothing behind for the next).

By default (no run.mlflow.tracking_uri, no MLFLOW_TRACKING_URI) the store is a sqlite file in
the run directory (RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlflow-artifacts): offline, and `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`
shows it. (MLflow 3's plain-file store refuses unless MLFLOW_ALLOW_FILE_STORE=true.) With
run.mlflow.tracking_uri=http://HOST:PORT the runs go to that server.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtlab.config.schema import MlflowOptions

# A server that is gone must cost seconds, not MLflow's default of 7 retries with
# exponential backoff and 120 s timeouts (minutes in which rank 0 holds up every rank).
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def key(name: str) -> str:
    """A metric or tag name MLflow accepts (letters, digits, _ - . / and spaces)."""
    return re.sub(r"[^\w\-. /]", "_", name)


def tracking_uri(configured: str | None, store_dir: Path) -> str:
    """run.mlflow.tracking_uri, else MLflow's own variable, else a sqlite file in store_dir."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(Path(store_dir) / 'mlflow.db').resolve()}"


def artifact_root(uri: str) -> str | None:
    """A sqlite store's artifacts beside its file (MLflow's default would be ./mlruns in
    whatever directory the run started from); a server chooses its own."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts").resolve().as_uri()


class MlflowTracker:
    name = "mlflow"
    settings = "run.mlflow and MLFLOW_TRACKING_URI"  # what decides where it logs

    def __init__(self, opts: MlflowOptions, run_dir: Path, run_id: str | None) -> None:
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        # A new sqlite store logs its schema set-up at INFO: not lines of the run's output.
        for logger in ("mlflow", "alembic"):
            logging.getLogger(logger).setLevel(logging.WARNING)

        self._metric, self._param, self._tag = Metric, Param, RunTag
        uri = tracking_uri(opts.tracking_uri, run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self._experiment(opts.experiment or "dtlab", artifact_root(uri))
        if run_id is not None:  # a resumed run goes on in the MLflow run it began
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            run = self.client.create_run(experiment, run_name=opts.run_name or Path(run_dir).name)
            self.run_id = run.info.run_id

    def _experiment(self, name: str, artifacts: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # another run (a sweep's, on SLURM) created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def params(self, params: dict[str, str]) -> None:
        # Parameters cannot change in MLflow: a resumed run logs only those it did not have.
        have = self.client.get_run(self.run_id).data.params
        new = [self._param(k, v) for k, v in params.items() if k not in have]
        if new:
            self.client.log_batch(self.run_id, params=new)

    def metrics(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(key(k), v, now, step)
                                                    for k, v in values.items()])

    def summary(self, values: dict[str, float | str], step: int) -> None:
        """Numbers as metrics `summary.KEY` at the last step (comparable across runs), text as
        tags."""
        now = int(time.time() * 1000)
        metrics = [self._metric(key(f"summary.{k}"), v, now, step) for k, v in values.items()
                   if not isinstance(v, str)]
        tags = [self._tag(key(f"summary.{k}"), v[:5000]) for k, v in values.items()
                if isinstance(v, str)]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def artifacts(self, run_dir: Path, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def end(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")
