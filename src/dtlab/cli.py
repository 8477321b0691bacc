"""`dtlab` command line: train, compare, sweep, collect, plot, report, comm, estimate, advise,
export, config, doctor.

Bad input ends with one line on stderr and exit code 2. torch is imported only when work starts,
so configuration mistakes are reported at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from dtlab.compare import compare
from dtlab.config import check_environment, check_world, load_config, to_yaml, valid_keys
from dtlab.errors import DtlabError
from dtlab.interrupt import Interrupted, handling, report


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (default: the built-in quick config)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="local worker processes (one per GPU); >1 starts them through torch elastic")
    p.add_argument("--nnodes", type=int, default=1, help="nodes taking part (multi-node torchrun)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (multi-node; default "
                   "127.0.0.1 with a free port)")
    p.add_argument("--rdzv-id", default="dtlab", help="job id shared by all nodes")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group "
                   "(each restart resumes from the latest checkpoint)")
    p.add_argument("--rdzv-conf", default="", help="extra rendezvous settings, e.g. is_host=true "
                   "on the node that hosts the c10d store")


def cmd_train(args: argparse.Namespace) -> int:
    world = args.nproc_per_node * args.nnodes
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise DtlabError("--nproc-per-node and --nnodes must be at least 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise DtlabError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT reachable from every node")
    cfg = load_config(args.config, args.overrides)  # fail before any process starts
    if world == 1:
        from dtlab.train import run

        return run(args.config, args.overrides)
    check_world(cfg, world, args.nproc_per_node)
    check_environment(cfg)
    from dtlab.launch import launch

    worker_args = (["--config", args.config] if args.config else []) + list(args.overrides)
    return launch(worker_args, args.nproc_per_node, args.nnodes, args.rdzv_endpoint,
                  args.rdzv_id, args.max_restarts, rdzv_conf=args.rdzv_conf)


def cmd_sweep(args: argparse.Namespace) -> int:
    from dtlab.sweeps import run_sweep

    if args.requeue and args.launcher != "slurm":
        raise DtlabError("--requeue needs --launcher slurm (a local run is resumed by running the "
                         "sweep again); fix: add --launcher slurm or drop --requeue")
    return run_sweep(args.spec, args.launcher, args.dry_run, args.out, args.timeout, args.requeue)


def cmd_collect(args: argparse.Namespace) -> int:
    from dtlab.results import collect, write_csv

    rows = collect(*map(Path, args.dirs))
    print(f"{len(rows)} runs -> {write_csv(rows, Path(args.output))}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from dtlab.results import plot_results, read_csv

    comm = [r for path in args.comm for r in read_csv(Path(path))]
    figures = plot_results(read_csv(Path(args.results)), Path(args.output), comm)
    for fig in figures:
        print(f"{Path(args.output) / fig['files'][0]}  {fig['title']}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dtlab.results import write_outputs

    write_outputs(Path(args.dir), Path(args.output) if args.output else None,
                  tuple(Path(c) for c in args.comm))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dtlab.export import export

    print(f"written: {export(Path(args.checkpoint), Path(args.output))}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(valid_keys()))
        return 0
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from dtlab.doctor import run_doctor

    if args.timeout <= 0:
        raise DtlabError(f"--timeout {args.timeout:g} is not positive; fix: e.g. --timeout 60")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise DtlabError("--nproc-per-node must be at least 1; fix: e.g. --nproc-per-node 2")
    return run_doctor(args.json, args.nproc_per_node, args.timeout, smoke=not args.no_smoke)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtlab", description="A distributed-training lab for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with one strategy (torchrun-compatible)")
    _add_launch_args(p)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. strategy.name=fsdp train.lr=0.1")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="run several strategies on one config and tabulate them")
    p.add_argument("--strategies", default="single,ddp,fsdp,fsdp1",
                   help="comma list; fsdp1:SHARD_GRAD_OP selects a sharding strategy, pp:gpipe a "
                        "pipeline schedule, @MP or @DPxMP a mesh (fsdp_tp@2x2 runs on 4 ranks)")
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N")
    p.add_argument("--config")
    p.add_argument("--out", default="runs/compare", help="directory for the runs and compare.csv")
    p.add_argument("--verify", action="store_true",
                   help="check per-step losses and final parameters against `single`")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest relative deviation allowed")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=compare)

    p = sub.add_parser("sweep", help="run every combination of a matrix, locally or on SLURM")
    p.add_argument("spec", help="sweep spec YAML (base config, overrides, matrix)")
    p.add_argument("--launcher", choices=["local", "slurm"], default="local")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--out", help="output directory (default: sweeps/<spec name>)")
    p.add_argument("--timeout", type=float, help="seconds per run (default: the spec's timeout_s)")
    p.add_argument("--requeue", action="store_true",
                   help="SLURM: a job stopped by SIGTERM (preemption, scontrol requeue) or by "
                        "run.checkpoint_signal saves a checkpoint and is requeued; it resumes there")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("collect", help="one CSV row per run found under the directories")
    p.add_argument("dirs", nargs="+")
    p.add_argument("-o", "--output", default="results.csv")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("plot", help="scaling, memory and accuracy figures from results.csv")
    p.add_argument("results")
    p.add_argument("comm", nargs="*", help="collective-benchmark CSVs (dtlab comm --csv)")
    p.add_argument("-o", "--output", default="plots")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="results.csv, plots and one self-contained report.html")
    p.add_argument("dir")
    p.add_argument("-o", "--output", help="default: DIR/report.html")
    p.add_argument("--comm", nargs="*", default=[], help="collective-benchmark CSVs")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("comm", help="collective benchmarks (nccl-tests format) and cost model")
    from dtlab.comm.cli import add_comm_arguments, run_comm

    add_comm_arguments(p)
    p.set_defaults(func=run_comm)

    from dtlab.estimate.cli import (
        add_advise_arguments,
        add_estimate_arguments,
        cmd_advise,
        cmd_estimate,
    )

    p = sub.add_parser("estimate", help="per-rank memory and communication of a setup, by arithmetic")
    add_estimate_arguments(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("advise", help="which strategy fits a GPU's memory, with the numbers and headroom")
    add_advise_arguments(p)
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("export", help="a checkpoint's full model as one safetensors file")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_NNNNNN")
    p.add_argument("-o", "--output", default="model.safetensors")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("config", help="print the resolved config (or --keys: every valid key)")
    p.add_argument("--config")
    p.add_argument("--keys", action="store_true")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("doctor", help="check torch, backends, devices, environment, network and "
                       "a 2-rank collective; each problem with its cause and fix (exit 1 on failure)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="ranks per node to check for "
                   "(default: LOCAL_WORLD_SIZE, else one per GPU, else 2)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before the collective "
                   "smoke test's ranks are killed (default 60)")
    p.add_argument("--no-smoke", action="store_true", help="skip the collective smoke test")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A signal stops every process of the command with one line and exit code 128 + the signal
    # number (dtlab/interrupt.py; docs/reliability.md#signals).
    with handling():
        try:
            return args.func(args)
        except DtlabError as e:
            print(f"dtlab: error: {e}", file=sys.stderr)
            return e.exit_code
        except Interrupted as e:
            return report(e)
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            return 0


def entry() -> NoReturn:
    """The `dtlab` command (and `python -m dtlab`): main(), then exit as distributed.leave() says
    when this process ran a process group (a 1-rank run trains in this process)."""
    code = main()
    if "dtlab.distributed" in sys.modules:  # imported only by runs that may hold a group
        sys.modules["dtlab.distributed"].leave(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
