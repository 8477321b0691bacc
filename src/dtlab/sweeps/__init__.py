"""`dtlab sweep SPEC.yaml`: run every combination of a matrix, locally or on SLURM, then collect.

A run that finished before (same config, same layout: same hash) is not run again; a failed or
timed-out one is recorded with its reason, the sweep goes on, and exits 1 at the end. The
results land in OUT/results.csv, OUT/plots/ and OUT/report.html. A stop signal stops the running
run (locally: passed on to its process group; on SLURM: its jobs are cancelled), marks it
`interrupted` and ends the sweep with one line; running the sweep again continues it.

The output directory belongs to one spec, by its resolved path and content (dtlab.owned, kind
"sweep"): another spec, or this one edited, is refused there before anything is written, so that
two sweeps' runs never count, plot and report as one. (A requeued SLURM job runs `dtlab train`
in its run directory, not the sweep: it claims nothing.)

A command: may import every layer below the commands (results, the run's record, process control,
config, the ground); never another command.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from pathlib import Path

from dtlab import owned
from dtlab.config import to_yaml
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted
from dtlab.run import dir_lock
from dtlab.run.sweep_record import failure_reason, is_done, now, read_record, update_record
from dtlab.sweeps import earlier_runs, slurm
from dtlab.sweeps.local import command, run_local
from dtlab.sweeps.spec import PlannedRun, SweepSpec, expand, load_spec


class Progress:
    """One line per event, led by the counts: done, failed, running, left."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.failed, self.running = total, done, 0, 0

    def event(self, run: PlannedRun, what: str) -> None:
        left = self.total - self.done - self.failed
        print(f"[done {self.done} | failed {self.failed} | running {self.running} | left {left}] "
              f"{run.label}: {what}", flush=True)

    def start(self, run: PlannedRun, what: str, **record: object) -> None:
        update_record(run.run_dir, status="running", started_at=now(), **record)
        self.running += 1
        self.event(run, what)

    def finish(self, run: PlannedRun, status: str, reason: str, code: int | None,
               seconds: float) -> None:
        update_record(run.run_dir, status=status, reason=reason, returncode=code,
                      finished_at=now(), duration_s=round(seconds, 2))
        self.running = max(0, self.running - 1)
        if status == "interrupted":  # the sweep's one line says it
            return
        if status == "done":
            self.done += 1
            summary = json.loads((run.run_dir / "summary.json").read_text())
            rate = summary.get("samples_per_s")  # None: no step was timed (a resume at the end)
            self.event(run, f"done in {seconds:.1f} s" + (f", {rate:.1f} samples/s" if rate
                                                         else ", no step timed"))
        else:
            self.failed += 1
            self.event(run, f"{status.upper()} after {seconds:.1f} s: {reason}")


def run_sweep(spec_path: str, launcher: str, dry_run: bool, out: str | None,
              timeout_s: float | None, requeue: bool = False) -> int:
    spec = load_spec(spec_path)
    out_dir = Path(out) if out else Path("sweeps") / Path(spec_path).stem
    plans = expand(spec, out_dir, launcher)
    flag = "--out" if out else "the sweep's output directory"
    mine = claim(out_dir, spec_path, flag)  # before is_done reads another sweep's runs as ours
    if dry_run:
        return _sweep(spec_path, spec, launcher, True, out, out_dir, plans, mine, timeout_s, requeue)
    with dir_lock.held(out_dir, flag, "sweep"):  # a second sweep here would run the same runs
        return _sweep(spec_path, spec, launcher, False, out, out_dir, plans, mine, timeout_s,
                      requeue)


def _sweep(spec_path: str, spec: SweepSpec, launcher: str, dry_run: bool, out: str | None,
           out_dir: Path, plans: list[PlannedRun], mine: owned.Owned, timeout_s: float | None,
           requeue: bool) -> int:
    timeout = timeout_s or spec.timeout_s
    earlier_runs.match(plans, out_dir)
    valid = [p for p in plans if not p.invalid]
    finished = [p for p in valid if is_done(p.run_dir)]
    todo = [p for p in valid if p not in finished]
    print(f"sweep {spec_path} ({launcher}): {len(plans)} combinations, {len(valid)} can run, "
          f"{len(finished)} already done, {len(todo)} to run; output in {out_dir}")
    for p in plans:
        if p.invalid:
            print(f"  skipped, cannot run: {p.label}: {p.invalid}")
    if dry_run:
        for p in valid:
            what = "done, kept" if p in finished else "would run"
            how = (" ".join(command(p.run_dir / "config.yaml", p.nproc_per_node))
                   if launcher == "local" else f"sbatch {p.run_dir / 'job.sbatch'} ({p.slurm_mode})")
            print(f"  {what}: {p.label} [{p.key}]\n      {how}")
        return 0

    mine.add("sweep.json", "runs")
    write_plan(out_dir, spec, plans, launcher)
    for p in todo:
        p.run_dir.mkdir(parents=True, exist_ok=True)
        (p.run_dir / "config.yaml").write_text(to_yaml(p.config))
        update_record(p.run_dir, key=p.key, label=p.label, combo=p.combo,
                      nproc_per_node=p.nproc_per_node, nnodes=p.nnodes, slurm_mode=p.slurm_mode,
                      launcher=launcher, status="planned", reason="", planned_at=now())
    progress = Progress(len(valid), len(finished))
    try:
        if launcher == "local":
            for p in todo:
                cmd = command(p.run_dir / "config.yaml", p.nproc_per_node)
                progress.start(p, "running", command=" ".join(cmd))
                t0 = time.monotonic()
                status, reason, code = run_local(cmd, p.run_dir, timeout)
                progress.finish(p, status, reason, code, time.monotonic() - t0)
                if interrupt.requested():  # the run stopped, or had just finished
                    raise Interrupted(interrupt.requested() or 0,
                                      stopped_where(p, reason) if status == "interrupted" else "")
        else:
            run_on_slurm(todo, spec, timeout, progress, requeue)
    except Interrupted as e:
        for p in todo:  # a run marked running when the signal came between two runs
            if (read_record(p.run_dir) or {}).get("status") == "running":
                update_record(p.run_dir, status="interrupted", reason="the sweep was interrupted",
                              finished_at=now())
        again = rerun_command(spec_path, launcher, out, timeout_s, requeue)
        e.where = (e.where or ": no run was running") + \
            f"; `{again}` continues the sweep (finished runs are kept)"
        raise
    return finish(out_dir, valid)


def claim(out_dir: Path, spec_path: str, flag: str) -> owned.Owned:
    """The output directory for this spec (`flag`: how the user named it), owned by its resolved
    path and content (NotOurs when it holds another's), and the report's outputs there checked:
    nothing is written."""
    path = Path(spec_path).resolve()
    digest = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    owned.check_not_nested(out_dir, flag, ("runs",))
    mine = owned.claim(out_dir, "sweep", digest, ("sweep.json", "runs"), flag, whose=str(path),
                       elsewhere="give this spec its own --out DIR")
    from dtlab.results import check_outputs  # the results layer: imported when used

    # the results it writes at the end: refused now, before any run
    check_outputs(out_dir, fix="give this spec its own --out DIR")
    return mine


def rerun_command(spec_path: str, launcher: str, out: str | None, timeout_s: float | None,
                  requeue: bool) -> str:
    """The command that continues this sweep: the same spec, launcher, output and limits."""
    args = [spec_path, *(["--launcher", launcher] if launcher != "local" else []),
            *(["--out", out] if out else []), *(["--timeout", f"{timeout_s:g}"] if timeout_s else []),
            *(["--requeue"] if requeue else [])]
    return "dtlab sweep " + shlex.join(args)


def stopped_where(p: PlannedRun, reason: str) -> str:
    """The stopped run's own line (in its log), as part of the sweep's one line."""
    said = re.search(r"interrupted by SIG\w+(.*)", reason)
    where = said.group(1) if said else ""
    return f": run '{p.label}' stopped{where.replace('; resume=auto continues from it', '')}"


def write_plan(out_dir: Path, spec: SweepSpec, plans: list[PlannedRun], launcher: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = {"spec": spec.model_dump(mode="json"), "launcher": launcher, "runs": [
        {"label": p.label, "combo": p.combo, "key": p.key, "invalid": p.invalid,
         "nproc_per_node": p.nproc_per_node, "nnodes": p.nnodes} for p in plans]}
    (out_dir / "sweep.json").write_text(json.dumps(plan, indent=2) + "\n")


def run_on_slurm(todo: list[PlannedRun], spec: SweepSpec, timeout: float,
                 progress: Progress, requeue: bool = False) -> None:
    jobs: dict[str, PlannedRun] = {}
    try:
        _run_on_slurm(todo, spec, timeout, progress, requeue, jobs)
    except Interrupted as e:  # the jobs are not children: cancel them (SIGTERM: they checkpoint)
        for job, p in jobs.items():
            slurm.cancel(job)
            update_record(p.run_dir, status="interrupted", finished_at=now(),
                          reason=f"the sweep was interrupted; job {job} was cancelled")
        e.where = f": cancelled {len(jobs)} SLURM job(s) of this sweep ({', '.join(jobs)})"
        raise


def _run_on_slurm(todo: list[PlannedRun], spec: SweepSpec, timeout: float, progress: Progress,
                  requeue: bool, jobs: dict[str, PlannedRun]) -> None:
    started: dict[str, float] = {}
    submitted = time.monotonic()
    for p in todo:
        script = p.run_dir / "job.sbatch"
        script.write_text(slurm.render(p, spec.slurm, timeout, Path.cwd(), requeue))
        job = slurm.submit(script)
        jobs[job] = p
        update_record(p.run_dir, status="submitted", job_id=job, command=f"sbatch {script}")
        progress.event(p, f"submitted as job {job} ({p.slurm_mode})")
    while jobs:
        time.sleep(spec.slurm.poll_s)
        active = slurm.active_jobs(list(jobs))
        for job, p in list(jobs.items()):
            state, count = active.get(job, (None, 0))
            if count > (read_record(p.run_dir) or {}).get("requeues", 0):  # preempted, requeued
                if job in started:
                    del started[job]  # the timeout starts again when it runs again
                    progress.running = max(0, progress.running - 1)
                update_record(p.run_dir, status="requeued", requeues=count)
                progress.event(p, f"job {job} was stopped and requeued ({count}); it resumes "
                                  "from its last checkpoint")
            if state == "RUNNING" and job not in started:
                started[job] = time.monotonic()
                progress.start(p, f"running (job {job})")
            if state and not (job in started and time.monotonic() - started[job] > timeout):
                continue
            if state:  # still running past its timeout
                slurm.cancel(job)
                status, reason, code = "timeout", f"exceeded the {timeout:g} s timeout; job {job} cancelled", None
            else:
                status, reason, code = judge(p, job)
            progress.finish(p, status, reason, code, time.monotonic() - started.get(job, submitted))
            del jobs[job]


def judge(p: PlannedRun, job: str) -> tuple[str, str, int | None]:
    state, code = slurm.final_state(job)
    log = p.run_dir / f"slurm-{job}.log"
    if state in ("COMPLETED", "UNKNOWN") and code in (0, None) and (p.run_dir / "summary.json").is_file():
        return "done", "", 0
    if state == "TIMEOUT":
        return "timeout", f"job {job} hit its SLURM time limit", code
    return "failed", f"SLURM state {state}, {failure_reason(log, code)}", code


def finish(out_dir: Path, valid: list[PlannedRun]) -> int:
    failed = [p for p in valid if (read_record(p.run_dir) or {}).get("status") != "done"]
    print(f"\n{len(valid) - len(failed)} of {len(valid)} runs done, {len(failed)} failed")
    for p in failed:
        record = read_record(p.run_dir) or {}
        print(f"  {record.get('status', 'unknown').upper()}: {p.label}: {record.get('reason', '')}")
    from dtlab.results import write_outputs

    write_outputs(out_dir)
    return 1 if failed else 0
