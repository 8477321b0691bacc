"""run.trackers=[tensorboard] (or run.tensorboard=true): event files in RUN_DIR/tb for
`tensorboard --logdir RUN_DIR/tb`. The run's files are already beside them: nothing to attach."""

from __future__ import annotations

from pathlib import Path


class TensorBoardTracker:
    name = "tensorboard"
    settings = "that run.dir can be written"
    run_id = ""

    def __init__(self, options: object, run_dir: Path, run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def summary(self, values: dict[str, float | str], step: int) -> None:
        for k, v in values.items():
            if not isinstance(v, str):
                self.writer.add_scalar(f"summary/{k}", v, step)
        self.writer.flush()

    def artifacts(self, run_dir: Path, paths: list[Path]) -> None:
        pass

    def end(self, finished: bool) -> None:
        self.writer.close()
