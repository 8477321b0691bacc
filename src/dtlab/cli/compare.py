"""`dtlab compare`: one config, several strategies, one table (and CSV/JSON).

Each strategy runs as its own `dtlab train` process, one after another, in `OUT/<label>/`. Every
run starts fresh (resume=none, the outputs of an earlier run in that directory removed first): a
comparison measures now, it never reuses numbers from another time, load or config. Only what a
compare recorded writing in OUT is replaced; anything else of those names is refused (dtlab.owned).
With --verify, every strategy's per-step losses and final parameters are checked against `single`
at the same global batch: the largest relative deviation is printed, and exceeding the tolerance
makes the command exit 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dtlab import owned
from dtlab.cli_args import output_dir
from dtlab.config import check_environment, check_world, load_config
from dtlab.config.strategies import registry
from dtlab.config.strategies.registry import fixed_ranks, mesh_mismatch
from dtlab.config.strategies.registry import parse as parse_spec
from dtlab.config.strategies.registry import ranks as spec_ranks
from dtlab.errors import ConfigError
from dtlab.instruments.machine_load import mfu_line, warning
from dtlab.process.interrupt import INTERRUPT_CODES, Interrupted, forwarding, requested
from dtlab.process.launcher_guard import launcher_env
from dtlab.results.outputs import report_outputs
from dtlab.run import dir_lock
from dtlab.run import owner as run_owner
from dtlab.run.neighbours import foreign_in_checkpoints
from dtlab.rundir.hints import RESUME_HINT_ENV

MiB = 1024 * 1024
DEFAULT_NPROC = 2  # ranks of a multi-process strategy without a mesh shape


def run_label(spec: str) -> str:
    """The spec as a directory name."""
    return spec.replace(":", "-").replace("@", "-")


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[float]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [
        r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    return summary, losses


def loss_deviation(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True))


def param_deviation(path: Path, reference: Path) -> float:
    """max over tensors of max|p - p_ref| / max|p_ref|."""
    from safetensors.torch import load_file

    a, b = load_file(str(path)), load_file(str(reference))
    if a.keys() != b.keys():
        return float("inf")
    return max(
        ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b
    )


def clear_run(run_dir: Path) -> None:
    """Remove an earlier run's outputs, so that nothing of it can be read as this run's (only
    in a directory compare recorded: its claim refused any other). The run's config.yaml too:
    a run refused before it writes its own must not leave the last one's beside nothing."""
    run_owner.clear_outputs(run_dir)
    (run_dir / "config.yaml").unlink(missing_ok=True)


def _round(value: float | None, digits: int, scale: float = 1.0) -> float | None:
    """None for what a run did not measure (no timed steps, no evaluation)."""
    return None if value is None else round(scale * value, digits)


def row_for(label: str, s: dict[str, Any]) -> dict[str, Any]:
    mem = s["memory_per_rank"]
    peak_key = "peak_allocated_bytes" if "peak_allocated_bytes" in mem else "peak_rss_bytes"
    state = [sum(v) for v in zip(mem["param_bytes"], mem["grad_bytes"], mem["optim_bytes"], strict=True)]
    comm = {}
    if s.get("comm_share") is not None:  # run.comm_breakdown=true
        comm = {"comm_share_pct": round(100 * s["comm_share"], 1),
                "exposed_comm_ms": round(1000 * s["exposed_comm_s"], 2),
                "comm_mib_per_step": round(s["comm_breakdown"]["payload_bytes_per_step"] / MiB, 3)}
    return {
        "strategy": label,
        "ranks": s["world_size"],
        "samples_per_s": _round(s.get("samples_per_s"), 1),
        "step_time_ms": _round(s.get("median_step_time_s"), 2, 1000),
        "tflops_per_rank": _round(s.get("tflops_per_rank"), 4),
        "mfu_pct": _round(s.get("mfu"), 1, 100),  # of summary.json's peak_tflops (mfu_note)
        "peak_mem_mib": round(max(mem[peak_key]) / MiB, 1),
        "param_mib": round(max(mem["param_bytes"]) / MiB, 3),
        "state_mib": round(max(state) / MiB, 3),
        "final_loss": _round(s.get("final_train_loss"), 6),
        "val_acc": _round(s.get("val_acc"), 4),
        **comm,
    }


def columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))  # single has no communication columns


def print_table(rows: list[dict[str, Any]], summaries: dict[str, dict[str, Any]]) -> None:
    """The table, what its speeds are of, and where each MFU's peak comes from (or why there
    is none): a number that cannot be true is shown as n/a, never as a result."""
    cols = columns(rows)
    cells = [{c: "n/a" if r.get(c, "") is None else str(r.get(c, "")) for c in cols} for r in rows]
    width = {c: max(len(c), *(len(r[c]) for r in cells)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols))
    for r in cells:
        print("  ".join(r[c].ljust(width[c]) for c in cols))
    print("samples_per_s, step_time_ms, tflops_per_rank, mfu_pct: of the median timed step")
    for r in rows:
        s = summaries[r["strategy"]]
        if s.get("mfu_note"):
            print(f"{r['strategy']}: {mfu_line(s)}")


def run_train(cmd: list[str]) -> int:
    """One strategy's `dtlab train`, in a process group of its own: a signal to compare is passed
    on to that group, the run stops (and says where), then compare stops with the same signal.
    The run dies with compare, however compare ends (dtlab/process/launcher_guard.py)."""
    with forwarding():
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, start_new_session=True,
                              env=launcher_env()).returncode
    if requested():  # the run said where it stopped, unless it had finished already
        raise Interrupted(requested() or 0, "; compare stopped before its table",
                          quiet=code in INTERRUPT_CODES)
    return code


def check_arguments(args: argparse.Namespace) -> dict[str, list[str]]:
    """{strategy spec: its overrides}, after checking every argument and every strategy against
    the config and its rank count: a mistake stops the comparison before any run starts."""
    specs = [s.strip() for s in args.strategies.split(",")]
    if not any(specs):
        raise ConfigError(f"--strategies '{args.strategies}' names no strategy; fix: e.g. "
                          "--strategies single,ddp,fsdp")
    for spec in specs:
        if not spec or specs.count(spec) > 1:
            what = "an empty entry" if not spec else f"'{spec}' twice"
            raise ConfigError(f"--strategies '{args.strategies}' has {what}; fix: list each "
                              "strategy once, separated by commas")
    if args.tolerance is not None and not args.verify:
        raise ConfigError("--tolerance applies to --verify; fix: add --verify, or remove "
                          "--tolerance")
    args.tolerance = 1e-5 if args.tolerance is None else args.tolerance
    if any(o.strip().startswith("run.dir=") for o in args.overrides):
        raise ConfigError("run.dir is chosen by compare (OUT/<strategy>); fix: remove the run.dir "
                          "override, and give --out DIR")
    if any(o.strip().startswith(("resume=", "run.overwrite=")) for o in args.overrides):
        raise ConfigError("resume and run.overwrite are chosen by compare (every comparison trains "
                          "anew: resume=none run.overwrite=true); fix: remove that override")
    if any(o.strip().startswith("strategy.name=") for o in args.overrides):
        raise ConfigError("strategy.name is chosen by --strategies (each strategy's run sets "
                          "it); fix: remove the strategy.name override, and list the strategies "
                          "in --strategies")
    output_dir("--out", args.out)
    ref = registry.REFERENCE
    if args.verify and ref not in specs:
        specs.insert(0, ref)
    from dtlab.models import check_model  # torch: imported when used

    # mistakes of the config itself and of its model (a Hugging Face directory), said once
    check_model(load_config(args.config, args.overrides).model)
    plans = {}
    for spec in specs:
        plans[spec] = parse_spec(spec)
    if args.nproc_per_node is not None:
        check_mesh_ranks(specs, args.nproc_per_node)
    args.nproc_per_node = args.nproc_per_node or DEFAULT_NPROC
    for spec in specs:
        nproc = spec_ranks(spec, args.nproc_per_node)
        try:
            cfg = load_config(args.config, [*args.overrides, *plans[spec]])
            check_world(cfg, nproc, nproc)
            check_environment(cfg)
        except ConfigError as e:
            raise ConfigError(f"--strategies {spec} on {nproc} rank(s): {e}") from None
    return plans


def check_mesh_ranks(specs: list[str], nproc: int) -> None:
    """--nproc-per-node given, and a mesh shape (@DPxMP) that asks for another number of ranks:
    refused when no strategy runs on --nproc-per-node (it would be ignored), else said before
    any run starts."""
    differ = [s for s in specs if mesh_mismatch(s, nproc, "--nproc-per-node")]
    if not differ:
        return
    if all(fixed_ranks(s) for s in specs):
        raise ConfigError(mesh_mismatch(differ[0], nproc, "--nproc-per-node"))
    meshes = ", ".join(f"{s} on {fixed_ranks(s)}" for s in differ)
    print(f"dtlab: note: {meshes} ranks (a mesh sets its ranks); the other strategies on "
          f"--nproc-per-node {nproc}", file=sys.stderr, flush=True)


def verify_numerics(args: argparse.Namespace) -> list[str]:
    """--verify on CUDA runs every strategy deterministically (run.deterministic, unless the
    overrides set it): GPU kernels that pick their reduction order at run time (atomics,
    autotuning, flash attention's backward) would make even two runs of one strategy differ."""
    if not args.verify:
        return []
    import torch

    cfg = load_config(args.config, args.overrides)
    uses_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    return ["run.deterministic=true"] if uses_cuda else []


def compare(args: argparse.Namespace) -> int:
    # A stopped run's line says what running compare again does: it never resumes (run/stop.py).
    before = os.environ.get(RESUME_HINT_ENV)
    os.environ[RESUME_HINT_ENV] = "compare does not resume: run again, it trains every strategy anew"
    try:
        return _compare(args)
    finally:
        if before is None:
            os.environ.pop(RESUME_HINT_ENV, None)
        else:
            os.environ[RESUME_HINT_ENV] = before


def _compare(args: argparse.Namespace) -> int:
    plans = check_arguments(args)
    out = Path(args.out)
    results_files = ("compare.csv", "compare.json")  # one owner: any compare's, nothing else
    if args.config and Path(os.path.abspath(out)) in Path(os.path.abspath(args.config)).parents:
        raise ConfigError(f"--config '{args.config}' is inside --out '{out}', whose runs this "
                          "compare replaces before it reads them; fix: copy it out first (e.g. cp "
                          f"{args.config} base.yaml) and pass that")
    earlier = owned.read(out)
    own = earlier["entries"] if earlier and earlier["kind"] == "compare" else []
    owned.check_not_nested(out, "--out", [*map(run_label, plans), *own])
    mine = owned.claim(out, "compare", "compare", [*map(run_label, plans), *results_files], "--out")
    with dir_lock.held(out, "--out", "compare"):  # a second compare here would replace these runs
        return _compare_in(args, plans, out, mine, results_files)


def _compare_in(args: argparse.Namespace, plans: dict[str, list[str]], out: Path,
                mine: owned.Owned, results_files: tuple[str, ...]) -> int:
    ref = registry.REFERENCE
    earlier = sorted(n for n in mine.entries - {*map(run_label, plans), *results_files}
                     if (out / n).is_dir())
    if earlier:  # an earlier compare's runs that this table would leave out, and collect mix in
        them = "it" if len(earlier) == 1 else "them"
        raise ConfigError(
            f"--out '{out}' holds {owned.shown(earlier)} from an earlier compare, which this one "
            f"does not run: its table would leave {them} out and collect and report would mix "
            f"{them} in; fix: add {them} to --strategies, --out a new directory, or move {them} "
            "away")
    theirs = [f"{run_label(spec)}/{name}" for spec in plans
              for name in foreign_in_checkpoints(out / run_label(spec))]
    if theirs:  # the runs below are replaced whole, their checkpoints folder with them
        them = "it" if len(theirs) == 1 else "them"
        raise ConfigError(f"--out '{out}' holds {owned.shown(theirs)}, which dtlab did not write "
                          f"and this compare would delete with the run it replaces; fix: move "
                          f"{them} out of the run's checkpoints/, or --out a new directory")
    reported = report_outputs(out)
    if reported:  # made of the earlier runs: they would describe runs that are gone
        raise ConfigError(f"--out '{out}' holds {', '.join(reported)}, which `dtlab report` made of "
                          "the earlier compare's runs and which this compare would leave "
                          "describing runs that are gone; fix: move them away, or --out a new "
                          "directory")
    for name in results_files:  # the earlier table goes first: a compare cut short leaves none
        if name in mine.entries:
            (out / name).unlink(missing_ok=True)
    replaced = [run_label(s) for s in plans if run_label(s) in mine.entries and
                (out / run_label(s)).is_dir()]
    if replaced:  # documented, and said: the user sees which runs are trained again
        print(f"dtlab compare: replacing the earlier compare's {owned.shown(replaced)} in "
              f"'{out}' (--out a new directory keeps them)", flush=True)
    for label in replaced:  # every earlier run goes before the first: one cut short leaves no mix
        clear_run(out / label)
    extra = ["run.progress=false"] + (["run.log_every=1", "run.save_model=true"] if args.verify else [])
    numerics = verify_numerics(args)  # before the overrides: an explicit setting wins
    rows, failed, results = [], [], {}
    for spec, spec_overrides in plans.items():
        label = run_label(spec)
        nproc = spec_ranks(spec, args.nproc_per_node)
        cmd = [sys.executable, "-m", "dtlab", "train", "--nproc-per-node", str(nproc)]
        cmd += ["--config", args.config] if args.config else []
        cmd += ["resume=none", *numerics, *args.overrides, *spec_overrides, *extra,
                "run.overwrite=true", f"run.dir={out / label}"]
        print(f"== {spec} on {nproc} rank(s)", flush=True)
        mine.add(label)  # recorded first: a run cut short is still ours to replace
        clear_run(out / label)
        code = run_train(cmd)
        if code:
            failed.append(f"{spec} (exit code {code})")
            continue
        results[spec] = read_run(out / label)
        if not results[spec][0].get("timed_steps"):  # e.g. resume=PATH of a finished run
            print(f"dtlab: warning: {spec} trained no timed steps: no speed to report",
                  file=sys.stderr)
        rows.append(row_for(spec, results[spec][0]))
        unreliable = warning(spec, results[spec][0])  # load or oversubscription: say so
        if unreliable:
            print(unreliable, file=sys.stderr, flush=True)

    bad = []
    if args.verify and ref in results:
        ref_losses = results[ref][1]
        for row in rows:
            spec = row["strategy"]
            dl = loss_deviation(results[spec][1], ref_losses)
            dp = param_deviation(out / run_label(spec) / "model.safetensors",
                                 out / run_label(ref) / "model.safetensors")
            row["loss_dev"], row["param_dev"] = f"{dl:.2e}", f"{dp:.2e}"
            if max(dl, dp) > args.tolerance:
                bad.append(f"{spec}: loss deviation {dl:.2e}, parameter deviation {dp:.2e}")
    if rows:
        print()
        print_table(rows, {spec: r[0] for spec, r in results.items()})
        mine.add(*results_files)
        with open(out / "compare.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns(rows))
            writer.writeheader()
            writer.writerows(rows)
        (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwritten: {out / 'compare.csv'}")
    if args.verify and ref in results:
        n = len(results[ref][1])
        verdict = "FAILED" if bad else "passed"
        print(f"verify {verdict}: {n} steps vs {ref}, tolerance {args.tolerance:g} (relative)")
        for line in bad:
            print(f"  {line}")
    for line in failed:
        print(f"dtlab: error: run failed: {line}", file=sys.stderr)
    return 1 if (failed or bad) else 0
