"""run.trackers=[wandb]: one Weights & Biases run per dtlab run.

Offline by default (run.wandb.mode unset and no WANDB_MODE in the environment): the run is written under RUN_DIR/wandb/ with no
network, and `wandb sync RUN_DIR/wandb/offline-run-*` uploads it later. run.wandb.mode=online
logs live, after `wandb login` (or WANDB_API_KEY).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtlab.config.schema import WandbOptions


class WandbTracker:
    name = "wandb"
    settings = "run.wandb and WANDB_MODE (online: `wandb login`)"  # what decides where it logs

    def __init__(self, opts: WandbOptions, run_dir: Path, run_id: str | None) -> None:
        import wandb

        self._wandb = wandb
        # console="off": dtlab's own lines (and its one-line errors) stay as they are, not
        # wrapped by wandb's capture of stdout and stderr.
        self.run: Any = wandb.init(
            project=opts.project, entity=opts.entity, group=opts.group,
            name=opts.name or Path(run_dir).name, dir=str(run_dir),
            mode=opts.mode or os.environ.get("WANDB_MODE") or "offline",
            id=run_id, resume="allow" if run_id else None, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self.run.id

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, float | str], step: int) -> None:
        self.run.summary.update(values)

    def artifacts(self, run_dir: Path, paths: list[Path]) -> None:
        if not paths:
            return
        artifact = self._wandb.Artifact(f"run-{self.run_id}-files", type="run-files")
        for path in paths:
            if path.is_dir():
                artifact.add_dir(str(path), name=path.name)
            else:
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def end(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)
        # The records reach the run directory when wandb's service process stops: stop it now
        # (dtlab has one wandb run per process), not when this process exits.
        self._wandb.teardown()
