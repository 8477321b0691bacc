"""`dtlab predict`: its arguments, and the table it prints (the numbers: core.py).

    dtlab predict --config configs/llama3_8b.yaml --world-size 64 --gpus-per-node 8 \\
        --cluster h100_sxm_8x --strategies ddp,fsdp,hsdp,zero1,fsdp_tp@8x8
    dtlab predict --config configs/quick.yaml --world-size 2 --cluster cpu_gloo --measure
    dtlab predict --config configs/quick.yaml --validate --strategies ddp,fsdp
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from dtlab.cli_args import integer, number
from dtlab.errors import DtlabError
from dtlab.process.result_stdout import print_result

DEFAULT_STRATEGIES = "ddp,fsdp,zero1"
GB = 1e9


def add_predict_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="dtlab YAML config: the model, batch, "
                   "precision and optimizer predicted (default: the built-in quick config)")
    p.add_argument("--world-size", type=integer(1, "--world-size 8"), metavar="N",
                   help="ranks (GPUs) in total (required unless --validate; with --validate: "
                   "validate on N local ranks only)")
    p.add_argument("--gpus-per-node", type=integer(1, "--gpus-per-node 8"), metavar="G",
                   help="ranks per node (default: the cluster's)")
    p.add_argument("--strategies", metavar="LIST", default=DEFAULT_STRATEGIES,
                   help=f"comma list of dtlab strategy specs, e.g. fsdp1:SHARD_GRAD_OP, "
                   f"fsdp@tp8 (a layout: flavour@degrees), fsdp_tp@8x8 (default: "
                   f"{DEFAULT_STRATEGIES})")
    p.add_argument("--cluster", metavar="NAME|FILE", help="a cluster file or the name of one in "
                   "configs/clusters (h100_sxm_8x, a100_sxm_8x, h200_sxm_8x, cpu_gloo); "
                   "required unless --validate")
    p.add_argument("--measure", action="store_true", help="measure the compute on this device "
                   "at each strategy's per-rank shapes (default: a roofline over the cluster's peak)")
    p.add_argument("--save-profile", metavar="FILE", help="with --measure: write what was "
                   "measured, for --profile on this or another machine")
    p.add_argument("--profile", metavar="FILE", help="compute from a profile file (--measure "
                   "--save-profile) instead of the roofline")
    p.add_argument("--step-time", type=number(0, "--step-time 0.5", inclusive=False),
                   metavar="SECONDS", help="with --profile: scale the profile so that its "
                   "single-device step takes this long (another machine's measured step)")
    p.add_argument("--threads", type=integer(1, "--threads 1"), metavar="N",
                   help="with --measure on a CPU: torch threads per rank (default: the cores "
                   "over the ranks per node, as dtlab train sets them)")
    p.add_argument("--jobs", type=integer(1, "--jobs 2"), metavar="N",
                   help="strategies traced side by side, one process each, where nothing is "
                   "timed (default: one per core; --measure: 1)")
    p.add_argument("--validate", action="store_true", help="run each strategy here on 1, 2 and 4 "
                   "local ranks (or --world-size N) and print the predicted step time beside "
                   "the measured one")
    p.add_argument("--tokens", metavar="N", help="also the days and GPU-hours to train N tokens "
                   "at each row's predicted speed, e.g. 15T, 300B, 1e12")
    p.add_argument("--gpu-hour-cost", type=number(0, "--gpu-hour-cost 2.5", inclusive=False),
                   metavar="PRICE", help="with --tokens: the price of one GPU-hour, for the "
                   "cost to train (in the same currency)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check one option at a time."""
    if not args.validate and (args.world_size is None or args.cluster is None):
        missing = "--world-size" if args.world_size is None else "--cluster"
        raise DtlabError(f"{missing} is required; fix: e.g. dtlab predict --config FILE "
                         "--world-size 64 --gpus-per-node 8 --cluster h100_sxm_8x")
    if args.validate:
        check_validate(args)
    if args.save_profile and not args.measure:
        raise DtlabError("--save-profile writes what --measure measured; fix: add --measure")
    if args.jobs and args.jobs > 1 and (args.measure or args.validate):
        raise DtlabError(f"--jobs {args.jobs}: a measured trace is timed, alone on the machine; "
                         "fix: drop --jobs")
    if args.gpu_hour_cost and not args.tokens:
        raise DtlabError("--gpu-hour-cost prices the GPU-hours to train --tokens N; fix: add "
                         "--tokens, e.g. --tokens 1T")
    if args.tokens and args.validate:
        raise DtlabError("--validate compares predicted with measured steps here; --tokens does "
                         "not apply; fix: drop --tokens")
    if args.tokens:
        from dtlab.predict.to_train import token_count

        token_count(args.tokens)
    if args.profile and args.measure:
        raise DtlabError("--profile and --measure both give the compute; fix: give one")
    if args.step_time and not args.profile:
        raise DtlabError("--step-time scales a profile; fix: add --profile FILE")
    tokens = [t.strip() for t in args.strategies.split(",")]
    if not all(tokens):
        raise DtlabError(f"--strategies '{args.strategies}' has an empty entry; fix: e.g. "
                         f"--strategies {DEFAULT_STRATEGIES}")
    twice = next((t for i, t in enumerate(tokens) if t in tokens[:i]), None)
    if twice:
        raise DtlabError(f"--strategies has '{twice}' twice; fix: list each strategy once")
    if args.world_size and args.gpus_per_node and args.world_size > args.gpus_per_node \
            and args.world_size % args.gpus_per_node:
        raise DtlabError(f"--world-size {args.world_size} is not a whole number of nodes of "
                         f"--gpus-per-node {args.gpus_per_node}; fix: a multiple of "
                         f"{args.gpus_per_node}")


def check_validate(args: argparse.Namespace) -> None:
    """--validate measures and runs here: options that describe another machine do not apply."""
    from dtlab.distributed import cpus_available

    other = next((o for o, v in (("--profile", args.profile), ("--step-time", args.step_time),
                                 ("--gpus-per-node", args.gpus_per_node)) if v), None)
    if other:
        raise DtlabError(f"--validate measures the compute and runs the ranks on this machine; "
                         f"{other} does not apply; fix: drop {other}")
    cores = cpus_available()
    if args.world_size and args.world_size > 2 * cores:
        raise DtlabError(f"--validate --world-size {args.world_size} would run "
                         f"{args.world_size} ranks on this machine's {cores} core(s): beyond 2 "
                         "a core the run times the queue for the cores, not the strategy; fix: "
                         f"--world-size {2 * cores} or fewer")


def request(args: argparse.Namespace, world: int, cluster: Any) -> Any:
    from dtlab.predict.core import Request
    from dtlab.predict.profile import load_profile

    per_node = args.gpus_per_node or min(world, cluster.gpus_per_node)
    profile = load_profile(args.profile) if args.profile else None
    if profile is not None and args.step_time:
        profile.scale_to(args.step_time)
    threads = args.threads
    if args.measure and threads is None and getattr(cluster, "cores", None):
        threads = max(1, cluster.cores // per_node)
    data_s = 0.0
    if args.measure and cluster.cores:  # the batch's loading, measured on this CPU (core.py)
        from dtlab.predict.core import data_seconds

        data_s = data_seconds(args.config, list(args.overrides))
    return Request(args.config, list(args.overrides), world, per_node, cluster, args.measure,
                   profile, threads, data_s)


def cmd_predict(args: argparse.Namespace) -> int:
    from dtlab.predict.cluster import load_cluster

    check_arguments(args)
    if args.validate:
        from dtlab.predict.validate import cmd_validate

        return cmd_validate(args)
    if args.save_profile:  # before minutes of work: refuse to replace a file that is not ours
        from pathlib import Path

        from dtlab.predict.profile import check_writable

        check_writable(Path(args.save_profile))
    cluster = load_cluster(args.cluster)
    req = request(args, args.world_size, cluster)
    rows = predict_all(req, [t.strip() for t in args.strategies.split(",")],
                       args.save_profile, args.jobs)
    from dtlab.predict.core import fastest
    from dtlab.predict.to_train import add_to_train, token_count

    if args.tokens:
        add_to_train(rows, token_count(args.tokens), args.gpu_hour_cost)
    best = fastest(rows)
    if args.json:
        print_result(json.dumps({"world_size": req.world, "ranks_per_node": req.ranks_per_node,
                                 "cluster": cluster.name, "rows": rows, "fastest": best},
                                indent=1))
        return 0
    print(f"dtlab predict: {req.world} ranks ({req.ranks_per_node} per node) of {cluster.name}"
          + (f", config {args.config}" if args.config else ""))
    print(table(rows))
    print(textwrap.fill(LEGEND, 100))
    if args.tokens:
        t = rows[0]["to_train"]
        print(f"days, GPU-h: to train {t['tokens']:.4g} tokens at that speed on {req.world} GPUs"
              + (f"; cost: GPU-h x {args.gpu_hour_cost:g}" if args.gpu_hour_cost else ""))
    print(verdict(best, rows))
    print(sources(rows, cluster))
    for r in rows:
        for note in r["notes"]:
            print(f"  ({note if note.startswith(r['strategy'] + ':') else r['strategy'] + ': ' + note})")
    return 0


def predict_all(req: Any, tokens: list[str], save_profile: str | None,
                jobs: int | None = None) -> list[dict[str, Any]]:
    from dtlab.predict.core import predict
    from dtlab.predict.profile import Profile
    from dtlab.predict.side_by_side import rows_side_by_side, workers

    rows, record = [], Profile({}) if save_profile else None
    count = workers(req, tokens, jobs)  # 1 with --measure (and so with --save-profile)
    if count > 1:
        return rows_side_by_side(req, tokens, count)
    for token in tokens:
        rows.append(predict(req, token, record))
    if record is not None:
        if not record.table:
            raise DtlabError(f"--save-profile {save_profile}: nothing was measured (every model "
                             "was too large to run here); fix: drop --save-profile")
        from pathlib import Path

        record.save(Path(save_profile))
    return rows


def ms(seconds: float | None) -> str:
    """Milliseconds to 0.1 from 10 ms up, three significant digits below (a small model's
    step on a GPU cluster is a fraction of a millisecond: "0.0" said nothing)."""
    return "-" if seconds is None else significant(seconds * 1e3)


def significant(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def table(rows: list[dict[str, Any]]) -> str:
    from dtlab.estimate.cli import table as text_table
    from dtlab.predict.memory import STATE_ONLY
    from dtlab.predict.to_train import columns as to_train_columns

    shown = []
    for r in rows:
        s = r["split"]
        shown.append({
            "strategy": r["strategy"], "step ms": ms(r["step_s"]) + (" !" if r["unreliable"] else ""),
            "samples/s": f"{r['samples_per_s']:.4g}",
            "tokens/s/dev": "-" if r["tokens_per_s"] is None
            else f"{r['tokens_per_s_per_device']:.4g}",
            "MFU": "n/a" if r["mfu"] is None else f"{significant(100 * r['mfu'])}%",
            "fwd": ms(s.get("forward")), "bwd": ms(s.get("backward")),
            "recomp": ms(s.get("recompute")), "optim": ms(s.get("optimizer")),
            "comm exposed": ms(sum(r["exposed_comm"].values())), "bubble": ms(s.get("bubble")),
            "GB/rank": significant(r["memory"]["device_bytes"] / GB),
            "fits": ("yes" if r["fits"] else "no") + (" (state)" if r["memory"]["source"]
                                                      == STATE_ONLY else ""),
            **to_train_columns(r)})
    return text_table(shown, list(shown[0]))


LEGEND = ("step ms: predicted time of one optimizer step (the slowest rank, plus the cluster's "
          "measured overhead of a real step beyond its simulation, and the batch's loading when "
          "measured here; '!': measured on a loaded machine, see its note); fwd/bwd/recomp/optim: "
          "that rank's compute by phase, ms; comm exposed: communication the compute waited for "
          "(the rest overlapped); bubble: pipeline stages idle; MFU: model FLOPs per second per "
          "device over the cluster's peak; GB/rank: dtlab estimate's memory at the peak")


def sources(rows: list[dict[str, Any]], cluster: Any) -> str:
    """Where the numbers came from, once for the table."""
    from dtlab.predict.cluster import first_clause

    compute = sorted({s for r in rows for s in r["sources"]["compute"]})
    tiers = sorted({t for r in rows for t in r["sources"]["comm"]})
    links = {"intra": cluster.intra, "inter": cluster.inter}
    lines = [f"compute: {'; '.join(compute) or '-'}"]
    lines += [f"{t}-node links: {first_clause(links[t].source)}" for t in tiers if t in links]
    lines.append(f"peak: {rows[0]['peak_source']}")
    for what, value, source in (
            ("compute overlapping communication", cluster.overlap_slowdown,
             cluster.overlap_slowdown_source),
            ("communication overlapping compute", cluster.comm_overlap_slowdown,
             cluster.comm_overlap_slowdown_source)):
        lines.append(f"{what}: {1 + value:.3g}x slower ({first_clause(source)})")
    if overhead := cluster.overhead_for(rows[0]["world_size"]):
        lines.append(f"a real step of {rows[0]['world_size']} ranks beyond its simulation: "
                     f"+{100 * overhead:.3g}% ({first_clause(cluster.step_overhead_source)})")
    return "\n".join(textwrap.shorten(line, 200) for line in lines)


def verdict(best: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    if best is None:
        return "fastest: none fits the cluster's memory per device"
    if "runner_up" not in best:
        return f"fastest that fits: {best['strategy']} ({ms(best['step_s'])} ms per step)"
    from dtlab.predict.core import CLOSE_CALL_WHY

    return (f"fastest that fits: {best['strategy']}, {best['speedup']:.2f}x the next "
            f"({best['runner_up']})" + (f"; {CLOSE_CALL_WHY}" if best["close_call"] else ""))
