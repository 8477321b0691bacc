"""What a run measures and how it is written: metrics.jsonl, summary.json, `[METRIC]` lines.

Memory is reported two ways. Peak memory per rank is what the allocator saw (CUDA: max allocated
and reserved; CPU: the process's peak RSS) over the timed steps (and the evaluations and summary
after them); the set-up's and the warm-up steps' peaks stand beside it as `setup_*` and
`warmup_*`, so that building a data set on the device or autotuning in the first steps does not
pass for what a step needs. State bytes per rank are exact: the bytes of the storages behind the
parameters, gradients and optimizer state this rank holds (local shards only, each storage counted
once). On CPU, glibc's allocator hides FSDP's savings from peak RSS, so the state bytes are the
honest comparison there.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from dtlab import files
from dtlab.errors import DtlabError, RunError
from dtlab.instruments.machine_load import mfu_line
from dtlab.instruments.trackers import Trackers
from dtlab.rundir.hints import intact_note

if TYPE_CHECKING:
    from dtlab.config import Config
    from dtlab.run.run_state import RunState, Training


def peak_memory(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}


def restart_peak(device: torch.device, phase: str) -> dict[str, int]:
    """The peaks so far, named `<phase>_<key>`; the next peak is counted from now."""
    so_far = {f"{phase}_{k}": v for k, v in peak_memory(device).items()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: the peak RSS (VmHWM, ru_maxrss) becomes the current RSS; elsewhere it runs on
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
    return so_far


def time_stats(times: list[float]) -> dict[str, float]:
    if not times:
        return {}
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"median": statistics.median(times), "p10": q[0], "p90": q[-1], "mean": statistics.fmean(times)}


def metric_line(record: dict[str, Any]) -> str:
    """`[METRIC] key=value ...`, the line format grep-based collectors parse."""
    def fmt(v: Any) -> str:
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    return "[METRIC] " + " ".join(f"{k}={fmt(v)}" for k, v in record.items())


class MetricsLog:
    """Rank 0 writes; other ranks call the same methods, which do nothing. What is logged also
    goes to the run's trackers (dtlab/instruments/trackers), which end with the run."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, progress: bool | str,
                 trackers: Trackers | None = None, resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.jsonl: TextIO | None = None
        self.bar = None
        self.trackers = trackers or Trackers([])
        self.summary_written = False
        self.lost_steps = 0  # steps completed after the checkpoint we resume from: they run again
        self.progress: TextIO | None = None
        self.logged_loss: float | None = None  # what the progress bar shows
        if not enabled:
            return
        self.run_dir = run_dir
        try:
            self._open(run_dir, total_steps, progress, resume_step)
        except OSError as e:  # before the first step: the run directory is unusable
            self._abandon()
            raise DtlabError(files.describe(e, f"writing into run.dir '{run_dir}'", "run.dir")) from None

    def _open(self, run_dir: Path, total_steps: int, progress: bool | str,
              resume_step: int | None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        kept = self._history(path, resume_step) if resume_step is not None else []
        if resume_step is not None:
            self.lost_steps = max(self.lost_steps, self._last_step(run_dir) - resume_step)
        # The history kept goes into a new file that replaces the old one once written: a full
        # disk here leaves the old metrics.jsonl as it was.
        tmp = path.with_name(path.name + ".tmp")
        self.jsonl = open(tmp, "w")  # noqa: SIM115 - closed in close()
        try:
            self.jsonl.writelines(line + "\n" for line in kept)
            self.jsonl.flush()
        except OSError:
            files.close_quietly(self.jsonl)
            self.jsonl = None
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        self.jsonl_bytes = self.jsonl.tell()
        # The last completed step, rewritten every step (not only every log_every steps), so that
        # a resume knows exactly how many steps a failure cost. No fsync: the kernel keeps the
        # write when the process is killed, which is the failure this is for.
        self.progress = open(run_dir / "progress", "w")  # noqa: SIM115 - closed in close()
        interactive = progress is True or (progress == "auto" and sys.stdout.isatty())
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def _history(self, path: Path, resume_step: int) -> list[str]:
        """The records up to the resumed step (a crash can leave a torn last line, a disk or a
        hand damaged ones: dropped)."""
        kept = []
        for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                continue
            if record.get("step", 0) <= resume_step:
                kept.append(line)
            elif "loss" in record:
                self.lost_steps = max(self.lost_steps, record["step"] - resume_step)
        return kept

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def log(self, record: dict[str, Any], quiet: bool = False) -> None:
        if not self.enabled:
            return
        assert self.jsonl is not None
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            self.jsonl_bytes = self.jsonl.tell()
        except OSError as e:
            with contextlib.suppress(OSError):  # no torn last line: the records end whole
                os.truncate(self.run_dir / "metrics.jsonl", self.jsonl_bytes)
            self._failed(e, self.run_dir / "metrics.jsonl", record.get("step"))
        self.trackers.metrics(record)
        if "loss" in record:
            self.logged_loss = record["loss"]
        if not quiet:
            self._print(metric_line(record))

    @staticmethod
    def _last_step(run_dir: Path) -> int:
        try:
            return int((run_dir / "progress").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def advance(self, step: int) -> None:
        """Step `step` is done. The bar shows the loss of the last logged step (the number in
        metrics.jsonl), none before the first."""
        if self.progress is not None:
            try:
                # one system call, in place (the width is fixed): no Python buffering to flush
                os.pwrite(self.progress.fileno(), f"{step:>12d}\n".encode(), 0)
            except OSError as e:
                self._failed(e, self.run_dir / "progress", step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if self.logged_loss is not None:
                self.bar.set_postfix(loss=f"{self.logged_loss:.4f}", refresh=False)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        path = self.run_dir / "summary.json"
        try:
            files.replace_whole(path, lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
        except OSError as e:
            self._failed(e, path, summary.get("steps"))
        self.summary_written = True
        self.trackers.summary(summary)
        flat = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and k in SUMMARY_LINE}
        if summary.get("mfu_note") and summary.get("mfu") is None and "peak_tflops" in summary:
            flat["mfu"] = "n/a"  # withheld: the line after says why
        self._print(metric_line({"summary": 1, **flat}))
        if summary.get("mfu_note"):
            self._print(mfu_line(summary))

    def close(self, keep_trackers: bool = False) -> None:
        """Close the files; the trackers too (finished when the summary was written, else
        failed), unless keep_trackers: the summary is still to come."""
        if self.bar is not None:
            self.bar.close()
        for f in (self.jsonl, self.progress):
            if f is not None:
                f.close()
        if not keep_trackers and self.enabled:
            self.trackers.end(self.run_dir, self.summary_written)

    def _abandon(self) -> None:
        """Close every file without flushing again what the disk refused."""
        for f in (self.jsonl, self.progress):
            if f is not None:
                files.close_quietly(f)
        self.jsonl = self.progress = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.trackers.end(self.run_dir, finished=False)

    def _failed(self, error: OSError, path: Path, step: int | None) -> None:
        """A write failed during training: stop the run with one line (rank 0 writes alone; the
        other ranks then see their next collective fail and are stopped by the launcher)."""
        self._abandon()
        where = f" at step {step}" if step is not None else ""
        raise RunError(f"{files.cause(error)} while writing '{path}'{where}; "
                       f"{intact_note(self.run_dir)}; fix: {files.fix(error, 'run.dir')}") from None


SUMMARY_LINE = (
    "strategy", "world_size", "steps", "median_step_time_s", "samples_per_s", "tokens_per_s",
    "final_train_loss", "val_loss", "val_acc", "wall_time_s", "tflops_per_rank", "peak_tflops",
    "mfu",
)



def log_step(cfg: Config, tr: Training, run: RunState, step_loss: torch.Tensor, lr: float,
             log: MetricsLog) -> None:
    """Every run.log_every steps (and the last): the loss over the global batch and the speed."""
    step, step_time = run.step, run.step_times[-1]
    if step % cfg.run.log_every == 0 or run.done:
        run.last_loss = tr.strategy.mean_loss(step_loss)
        samples_per_s = cfg.train.global_batch_size / step_time
        record = {"step": step, "epoch": run.epoch, "loss": run.last_loss, "lr": lr,
                  "step_time_s": step_time, "data_time_s": run.data_times[-1],
                  "samples_per_s": samples_per_s}
        if tr.spec.kind == "tokens":
            record["tokens_per_s"] = samples_per_s * tr.spec.seq_len
        log.log(record)
    log.advance(step)
