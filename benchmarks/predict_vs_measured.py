"""`dtlab predict`'s step time against real runs here, and its collectives against a real step's.

    python benchmarks/predict_vs_measured.py [--configs gpt,cnn] [--strategies ddp,fsdp,...]
        [--ranks 1,2,4] [--variants base,accum,ac] [--steps N] [--cluster cpu_gloo] [--interleave]
        [--no-collectives | --collectives-only] [--json FILE]

For each row (config, variant, strategy, ranks): the predicted step (dtlab.predict.core.
predict_step: compute measured on this CPU at the strategy's per-rank shapes, communication
priced by the cluster file, one step simulated) beside the median step of a real `dtlab train`
of `--steps` steps (STEPS below) on as many local gloo ranks (dtlab.predict.truth.measure_run),
the median of `--runs` such runs (the same program's step differs from run to run here, by up
to 30% for the CNN at 2 ranks, a hand-written DDP loop as much: docs/benchmarks.md), and the
error. With --fresh each prediction runs in a process of its own, as each run does: a process
keeps one speed for its life here, and a single predicting process biases every row alike;
then the mean absolute error and the largest. With --interleave, the row is predicted again
before each run (the compute measured anew each time) and the medians are compared: this host's
speed drifts by more than the model's errors over an hour (docs/benchmarks.md), and predicting
once, then running three times, lets the drift between the two land in the error. Where 4
ranks share 2 cores, the run shares them and the prediction says how it scaled the compute (its
notes and sources).

Variants: base; accum (train.grad_accum_steps=2: no-sync micro steps); ac (full activation
checkpointing: the recompute). The default matrix (~15 min on 2 cores): the base variant for
every strategy that applies (tp and pp: GPT only) on 2 and 4 ranks, ddp and fsdp on 1 rank too;
accum and ac at 2 ranks for ddp, fsdp, zero1, tp and pp. --full: every combination. A configuration a strategy cannot take (a world size, a model)
is listed as skipped, with the reason.

Collectives: every 4-rank run records its last step's collectives per rank (flight recorder +
dtlab's own record of gloo's point-to-point and reduce-scatter, see dtlab/predict/truth.py), and
each rank's trace under the recording fake process group must issue the same (count, op, bytes,
group size, in order): the acceptance at 4 ranks (2 ranks: tests/test_predict_collectives.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

from dtlab.config import load_config
from dtlab.config.strategies.registry import parse as parse_spec
from dtlab.errors import ConfigError
from dtlab.predict.truth import measure_run, split_alone

ROOT = Path(__file__).resolve().parents[1]
# Steps per run, unless --steps: enough that a run's median step holds still from run to run.
# The CNN's steps are short and spread wide (10-70 ms; at 4 ranks on 2 cores one run's p10-p90
# was 11-25 ms), so it takes 96 timed steps. Five runs of each, interleaved, 2026-11-29: ddp x4
# 13.2-19.6 ms at 48 steps, 15.9-17.2 at 144; ddp x2 8.3-11.0 and 8.0-8.9; fsdp x1 8.7-15.4 and
# 8.5-9.2. The GPT's 12 steps do (ddp x4 85.7-97.1 ms at 12 steps, 87.4-90.0 at 36).
STEPS = {"gpt": 12, "cnn": 144, "calib": 24}
CONFIGS = {  # label -> (config file, overrides): small enough that a run takes seconds here
    "gpt": (str(ROOT / "configs/tp_gpt.yaml"), ["data.synthetic.train_samples=2048",
                                    "data.synthetic.val_samples=64"]),
    "cnn": (str(ROOT / "configs/quick.yaml"), ["data.synthetic.train_samples=1024",
                                   "data.synthetic.val_samples=64"]),
    # Not in the matrix: the model benchmarks/calibrate_cpu.py measures the cluster file's
    # step_overhead on (another depth, width and sequence than "gpt": held out from the check)
    "calib": (str(ROOT / "configs/tp_gpt.yaml"), [
        "model.n_layer=3", "model.n_embd=96", "model.n_head=3", "model.block_size=96",
        "data.synthetic.train_samples=2048", "data.synthetic.val_samples=64"]),
}
MATRIX = ["gpt", "cnn"]

def model_parallel(strategy: str) -> bool:
    """Splits a model's layers (tp, fsdp_tp, pp: the registry says which): GPT only here."""
    from dtlab.config.strategies import registry

    return registry.get(strategy.partition(":")[0].partition("@")[0]).model_parallel is not None

STRATEGIES = ["ddp", "fsdp", "fsdp1", "zero1", "hsdp", "tp", "fsdp_tp", "pp"]
if importlib.util.find_spec("deepspeed") is not None:
    STRATEGIES += ["deepspeed:1", "deepspeed:2", "deepspeed:3"]
VARIANTS = {"base": [], "accum": ["train.grad_accum_steps=2"],
            "ac": ["train.activation_checkpointing=full"]}
VARIANT_ROWS = {"strategies": {"ddp", "fsdp", "zero1", "tp", "pp"}, "ranks": {2}}
ONE_RANK = {"ddp", "fsdp"}  # on 1 rank the strategies differ little: the compute path, measured


def predict(cfg_path: str, overrides: list[str], strategy: str, ranks: int,
            cluster: Any) -> dict[str, Any]:
    """THE prediction under test: the one call into dtlab.predict's pipeline."""
    from dtlab.predict.core import predict_step

    return predict_step(cfg_path, overrides, strategy, ranks, cluster)


def predict_fresh(*args: Any) -> dict[str, Any]:
    """predict(*args) in a process of its own, as each run has: here a process keeps one speed
    for its life, up to 2x from one process to the next (docs/prediction.md, appendix: half-speed
    processes), and predicting every row in this one process would carry its speed into all of
    them."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from dtlab.process.launcher_guard import die_with_parent

    # die_with_parent: a benchmark stopped by a signal must not leave its predicting process
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"),
                             initializer=die_with_parent) as pool:
        return pool.submit(predict, *args).result()


def predicted_collectives(cfg_path: str, overrides: list[str], strategy: str,
                          ranks: int) -> dict[int, tuple[list[tuple[str, int, int]], int]]:
    """{rank: (its traced collectives, how many over a group of one it left out)}."""
    from dtlab.predict.trace import collectives_of, trace_step

    cfg = load_config(cfg_path, [*overrides, *parse_spec(strategy)])
    out = {}
    for rank in range(ranks):
        trace = trace_step(cfg, ranks, rank, ranks, device="cpu")
        out[rank] = (collectives_of(trace), int(trace.meta.get("alone", 0)))
    return out


def compare_collectives(cfg_path: str, overrides: list[str], strategy: str,
                        recorded: dict[int, list]) -> str:
    """'equal (N per rank)', where the first rank that differs does, or why no trace was made."""
    try:
        predicted = predicted_collectives(cfg_path, overrides, strategy, len(recorded))
    except Exception as e:  # one row's failure must not lose the others  # noqa: BLE001
        return f"not traced: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
    for rank in sorted(recorded):
        (p, p_alone), (r, r_alone) = predicted[rank], split_alone(recorded[rank])
        if p_alone != r_alone:
            return (f"rank {rank}: {p_alone} collectives over a group of one traced, "
                    f"{r_alone} recorded")
        if p != r:
            at = next((i for i, (a, b) in enumerate(zip(p, r, strict=False)) if a != b),
                      min(len(p), len(r)))
            return (f"rank {rank}: {len(p)} predicted, {len(r)} recorded; first difference at "
                    f"#{at}: predicted {p[at] if at < len(p) else None}, recorded "
                    f"{r[at] if at < len(r) else None}")
    counts = sorted({len(split_alone(r)[0]) for r in recorded.values()})
    return f"equal ({'/'.join(map(str, counts))} per rank)"


def matrix(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    rows = []
    for config in args.configs:
        for variant in args.variants:
            for strategy in args.strategies:
                if model_parallel(strategy) and config == "cnn":
                    continue
                for ranks in args.ranks:
                    if ranks == 1 and strategy not in ONE_RANK and not args.full:
                        continue
                    if variant != "base" and not args.full and (
                            strategy not in VARIANT_ROWS["strategies"]
                            or ranks not in VARIANT_ROWS["ranks"]):
                        continue
                    rows.append((config, variant, strategy, ranks))
    return rows


def run_row(config: str, variant: str, strategy: str, ranks: int, args: argparse.Namespace,
            cluster: Any) -> dict[str, Any]:
    from dtlab.predict.core import Request, strategy_config

    path, overrides = CONFIGS[config]
    overrides = [*overrides, *VARIANTS[variant]]
    row: dict[str, Any] = {"config": config, "variant": variant, "strategy": strategy,
                           "ranks": ranks}
    try:
        strategy_config(Request(path, overrides, ranks, ranks, cluster), strategy)
    except ConfigError as e:
        return {**row, "skipped": str(e)}
    record = ranks == 4 and args.collectives
    if args.collectives_only:  # 3 steps: DDP's bucket rebuild in step 2, the recorded step 3
        measured = measure_run(path, [*overrides, *parse_spec(strategy)], ranks, 3, record=True)
    else:
        steps = args.steps or STEPS[config]
        guesses, runs = [], []
        for i in range(args.runs):  # predict, run, predict, run: the host's drift hits both
            if i == 0 or args.interleave:
                try:
                    guess = predict_fresh if args.fresh else predict
                    guesses.append(guess(path, overrides, strategy, ranks, cluster))
                except Exception as e:  # one row's failure must not lose the others  # noqa: BLE001
                    return {**row, "skipped": f"prediction failed: {type(e).__name__}: "
                                              f"{str(e).strip().splitlines()[0]}"}
            runs.append(measure_run(path, [*overrides, *parse_spec(strategy)], ranks, steps,
                                    record=record and i == 0))
        measured = runs[0]
        predicted_s = statistics.median(g["step_s"] for g in guesses)
        step = statistics.median(r["step_s"] for r in runs)
        row |= {"predicted_s": predicted_s, "measured_s": step, "steps": steps,
                "predicted_runs_s": [g["step_s"] for g in guesses],
                "measured_runs_s": [r["step_s"] for r in runs],
                "error": predicted_s / step - 1,
                "sources": guesses[0]["sources"], "notes": guesses[0]["notes"]}
    if record or args.collectives_only:
        row["collectives"] = compare_collectives(path, overrides, strategy,
                                                 measured["collectives"])
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | variant | strategy | ranks | predicted ms (each) | measured ms (runs) "
             "| error |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            each = ", ".join(f"{t * 1e3:.1f}" for t in r.get("measured_runs_s", []))
            guesses = r.get("predicted_runs_s", [])
            said = f" ({', '.join(f'{t * 1e3:.1f}' for t in guesses)})" if len(guesses) > 1 else ""
            lines.append(f"| {r['config']} | {r['variant']} | {r['strategy']} | {r['ranks']} | "
                         f"{r['predicted_s'] * 1e3:.1f}{said} | {r['measured_s'] * 1e3:.1f} "
                         f"({each}) | {100 * r['error']:+.1f}% |")
    errors = [abs(r["error"]) for r in rows if "error" in r]
    if errors:
        lines.append(f"\nmean |error| {100 * sum(errors) / len(errors):.1f}%, largest "
                     f"{100 * max(errors):.1f}%, over {len(errors)} rows")
    checked = [r for r in rows if "collectives" in r]
    if checked:
        lines += ["", "| config | variant | strategy | ranks | collectives, predicted vs recorded |",
                  "|---|---|---|---:|---|"]
        lines += [f"| {r['config']} | {r['variant']} | {r['strategy']} | {r['ranks']} | "
                  f"{r['collectives']} |" for r in checked]
    lines += [f"\n- skipped: {r['config']} {r['variant']} {r['strategy']} on {r['ranks']} ranks: "
              f"{r['skipped']}" for r in rows if "skipped" in r]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    split = lambda s: [t.strip() for t in s.split(",") if t.strip()]  # noqa: E731
    parser.add_argument("--configs", type=split, default=MATRIX,
                        help=f"of {', '.join(CONFIGS)} (default: {','.join(MATRIX)})")
    parser.add_argument("--strategies", type=split, default=STRATEGIES)
    parser.add_argument("--ranks", type=lambda s: [int(n) for n in split(s)], default=[1, 2, 4])
    parser.add_argument("--variants", type=split, default=list(VARIANTS))
    parser.add_argument("--full", action="store_true",
                        help="every variant for every strategy and rank count (hours)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run, a third warm-up (default: gpt 12, cnn 144)")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs per row; measured: the median of their median steps")
    parser.add_argument("--fresh", action="store_true",
                        help="each prediction in a new process, as each run is (predict_fresh)")
    parser.add_argument("--interleave", action="store_true",
                        help="predict again before each run (the compute measured anew), and "
                             "compare the medians: a drifting host's speed hits both sides")
    parser.add_argument("--cluster", default="cpu_gloo")
    parser.add_argument("--no-collectives", dest="collectives", action="store_false",
                        help="skip the 4-rank collectives check")
    parser.add_argument("--collectives-only", action="store_true",
                        help="only the collectives check, on --ranks (default 4), no timing")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = parser.parse_args()
    unknown = [c for c in args.configs if c not in CONFIGS] + \
        [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)} (configs: {', '.join(CONFIGS)}; variants: "
                     f"{', '.join(VARIANTS)})")

    from dtlab.predict.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    if args.collectives_only and args.ranks == [1, 2, 4]:
        args.ranks, args.variants = [4], ["base"]
    rows, started = [], time.monotonic()
    for config, variant, strategy, ranks in matrix(args):
        row = run_row(config, variant, strategy, ranks, args, cluster)
        rows.append(row)
        said = [f"skipped ({row['skipped']})"] if "skipped" in row else []
        if "error" in row:
            said.append(f"predicted {row['predicted_s'] * 1e3:.1f} ms, measured "
                        f"{row['measured_s'] * 1e3:.1f} ms, {100 * row['error']:+.1f}%")
        if "collectives" in row:
            said.append(f"collectives {row['collectives']}")
        print(f"[{time.monotonic() - started:5.0f} s] {config} {variant} {strategy} x{ranks}: "
              f"{'; '.join(said)}", flush=True)
    steps = args.steps or ", ".join(f"{c} {n}" for c, n in STEPS.items() if c in args.configs)
    print(f"\n{time.strftime('%Y-%m-%d')}, cluster {cluster.name}, steps per run: {steps}\n")
    print(markdown(rows))
    if args.json:
        errors = [abs(r["error"]) for r in rows if "error" in r]
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cluster": cluster.name, "steps": steps,
            "interleaved": args.interleave, "fresh": args.fresh,
            "rows": rows, "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "max_abs_error": max(errors, default=None)}, indent=1))


if __name__ == "__main__":
    main()
