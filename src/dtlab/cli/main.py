"""`dtlab` command line: train, compare, sweep, collect, plot, report, comm, estimate, advise,
export, prepare, sample, config, doctor.

Bad input ends with one line on stderr and exit code 2. torch is imported only when work starts,
so configuration mistakes are reported at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from dtlab import owned
from dtlab.cli.compare import compare
from dtlab.cli_args import (
    CommandParser,
    Parser,
    add_launch_arguments,
    input_dir,
    input_file,
    integer,
    number,
    output_dir,
    output_file,
)
from dtlab.config import check_environment, check_world, load_config, to_yaml, valid_keys
from dtlab.errors import DtlabError
from dtlab.process.early_exit import finishing
from dtlab.process.interrupt import Interrupted, handling, lost, report
from dtlab.process.result_stdout import stdout_kept_for_result


def cmd_train(args: argparse.Namespace) -> int:
    world = args.nproc_per_node * args.nnodes
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise DtlabError("--nnodes > 1 needs --rdzv-endpoint; fix: add --rdzv-endpoint HOST:PORT "
                         "reachable from every node")
    if args.nnodes > 1 and args.rdzv_endpoint.endswith(":0"):
        raise DtlabError(f"--rdzv-endpoint {args.rdzv_endpoint}: port 0 cannot be shared between "
                         "nodes; fix: give a free port, e.g. HOST:29400")
    if world == 1:
        for flag, value, default in (("--max-restarts", args.max_restarts, 0),
                                     ("--rdzv-endpoint", args.rdzv_endpoint, None),
                                     ("--rdzv-id", args.rdzv_id, "dtlab"),
                                     ("--rdzv-conf", args.rdzv_conf, "")):
            if value != default:
                raise DtlabError(f"{flag} applies to runs of 2 ranks or more, and this one has "
                                 f"1; fix: remove {flag}, or add --nproc-per-node 2")
    cfg = load_config(args.config, args.overrides)  # fail before any process starts
    if world == 1:
        from dtlab.train import run

        return run(args.config, args.overrides)
    check_world(cfg, world, args.nproc_per_node)
    check_environment(cfg)
    from dtlab.models import check_model_size  # torch: the launcher imports it anyway

    check_model_size(cfg)
    if cfg.data.name == "tokens":  # every rank would find a bad token file: say it once, here
        from dtlab.data import tokens

        tokens.check_dataset(Path(cfg.data.dir))  # sizes and checksums against meta.json
        for split in ("train", "val"):
            tokens.open_split(Path(cfg.data.dir), split, cfg.model.vocab_size, cfg.model.block_size,
                              cfg.model.VOCAB_KEY)
    from contextlib import nullcontext

    from dtlab.process.launch import launch
    from dtlab.run.dir_lock import held

    worker_args = (["--config", args.config] if args.config else []) + list(args.overrides)
    # One node: this process holds the run directory for its ranks (and their restarts). Several:
    # the node that gets rank 0 is known only after the rendezvous, so rank 0 takes it.
    with held(cfg.run.run_dir) if args.nnodes == 1 else nullcontext():
        return launch(worker_args, args.nproc_per_node, args.nnodes, args.rdzv_endpoint,
                      args.rdzv_id, args.max_restarts, rdzv_conf=args.rdzv_conf)


def cmd_sweep(args: argparse.Namespace) -> int:
    from dtlab.sweeps import run_sweep

    if args.requeue and args.launcher != "slurm":
        raise DtlabError("--requeue needs --launcher slurm (a local run is resumed by running the "
                         "sweep again); fix: add --launcher slurm or drop --requeue")
    if args.out:
        output_dir("--out", args.out)
    return run_sweep(args.spec, args.launcher, args.dry_run, args.out, args.timeout, args.requeue)


def cmd_collect(args: argparse.Namespace) -> int:
    from dtlab.results import collect, write_csv

    for d in args.dirs:
        input_dir("DIR", d, "pass the directory of a sweep, a compare or a set of logs")
    output = output_file("-o/--output", args.output, "results.csv")
    owned.check_made_from(output, "-o/--output", args.dirs)
    rows = collect(*map(Path, args.dirs))
    print(f"{len(rows)} runs -> {write_csv(rows, output)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from dtlab.results import plot_results, read_csv
    from dtlab.results.plot import check_plottable

    fix = "write it with `dtlab collect DIR -o results.csv`"
    results = input_file("RESULTS_CSV", args.results, fix)
    for path in args.comm:
        input_file("COMM_CSV", path, "write it with `dtlab comm --csv comm.csv`")
    out = output_dir("-o/--output", args.output)
    owned.check_made_from(out, "-o/--output", [Path(p).parent for p in (results, *args.comm)])
    rows = read_csv(results)
    comm = [r for path in args.comm for r in read_csv(Path(path))]
    check_plottable(rows, results, comm)
    figures = plot_results(rows, out, comm)
    for fig in figures:
        print(f"{out / fig['files'][0]}  {fig['title']}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dtlab.results import write_outputs
    from dtlab.results.run_report import is_run_dir, write_run_report

    root = input_dir("DIR", args.dir, "pass the directory of a sweep, a compare or one run")
    if is_run_dir(root):  # one run: its own report; a sweep holds its runs one level down
        if args.comm:
            raise DtlabError(f"--comm adds collective benchmarks to a sweep's report, and '{root}' "
                             "is one run; fix: drop --comm, or pass the sweep's directory")
        output = output_file("-o/--output", args.output, "report.html") if args.output else None
        if output:
            owned.check_made_from(output, "-o/--output", [root])
        print(f"report: {write_run_report(root, output)}")
        return 0
    for path in args.comm:
        input_file("--comm", path, "write it with `dtlab comm --csv comm.csv`")
    several = owned.commands_below(root) if owned.read(root) is None else []
    if len(several) > 1:
        names = ", ".join(f"{r['kind']} '{p}'" for p, r in several[:3])
        raise DtlabError(f"'{root}' holds the outputs of {len(several)} commands ({names}"
                         f"{', ...' if len(several) > 3 else ''}), whose runs one report would draw "
                         f"as one series; fix: report each of them, or collect them with their "
                         f"source column (dtlab collect {root} -o all.csv)")
    output = output_file("-o/--output", args.output, "report.html") if args.output else None
    if output:
        owned.check_made_from(output, "-o/--output", [root])
    write_outputs(root, output, tuple(Path(c) for c in args.comm))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dtlab.text.export import (
        DEFAULT_SHARD,
        check_outside_checkpoint,
        export,
        export_hf,
        parse_size,
        said_of,
    )

    checkpoint = input_dir("CHECKPOINT", args.checkpoint,
                           "pass a checkpoint directory, RUN_DIR/checkpoints/step_NNNNNN")
    inside = args.output and (Path(args.output).resolve() == checkpoint.resolve() or
                              checkpoint.resolve() in Path(args.output).resolve().parents)
    if inside:  # said before "is a directory", whose fix would name a path inside it
        check_outside_checkpoint(Path(args.output), checkpoint)
    if args.format == "hf":
        max_shard = parse_size(args.max_shard_size or DEFAULT_SHARD)
        out = Path(args.output or "hf-model")
        said = said_of(out, "hf")
        print(f"{said}: {export_hf(checkpoint, out, max_shard, args.overwrite)}")
        return 0
    if args.max_shard_size is not None:
        raise DtlabError("--max-shard-size applies to --format hf; fix: add --format hf, or "
                         "drop --max-shard-size")
    output = output_file("-o/--output", args.output or "model.safetensors", "model.safetensors")
    said = said_of(output, "safetensors")
    print(f"{said}: {export(checkpoint, output, args.overwrite)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        if args.config or args.overrides:
            raise DtlabError("--keys lists the keys of every config and takes no --config or "
                             "overrides; fix: drop --keys to print the resolved config")
        print("\n".join(valid_keys()))
        return 0
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from dtlab.doctor import run_doctor

    if args.check == "hang":
        from dtlab.doctor.hang import report as hang_report

        if args.run_dir is None:
            raise DtlabError("dtlab doctor hang needs the run's directory; fix: dtlab doctor "
                             "hang RUN_DIR (the run.dir of the run that hung)")
        print(hang_report(input_dir("RUN_DIR", args.run_dir, "pass the run.dir of the run "
                                    "that hung")))
        return 0
    if args.run_dir is not None:
        raise DtlabError(f"dtlab doctor takes no directory (got '{args.run_dir}'); fix: dtlab "
                         "doctor, or dtlab doctor hang RUN_DIR")
    return run_doctor(args.json, args.nproc_per_node, args.timeout, smoke=not args.no_smoke)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dtlab", description="A distributed-training lab for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=CommandParser)

    p = sub.add_parser("train", help="train with one strategy (torchrun-compatible)")
    add_launch_arguments(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. strategy.name=fsdp train.lr=0.1 "
                   "(`dtlab config --keys` lists the keys)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="run several strategies on one config and tabulate them")
    p.add_argument("--strategies", default="single,ddp,fsdp,fsdp1", metavar="LIST",
                   help="comma list of strategies; fsdp1:SHARD_GRAD_OP selects a sharding "
                        "strategy, pp:gpipe a pipeline schedule; a layout is the data-parallel "
                        "flavour @ model-parallel degrees (fsdp@tp2: FSDP2 over tensor-parallel "
                        "pairs; single@pp2 runs on 2 ranks); @MP or @DPxMP a mesh "
                        "(fsdp_tp@2x2 runs on 4 ranks)")
    p.add_argument("--nproc-per-node", type=integer(1, "--nproc-per-node 2"), metavar="N",
                   help="ranks of each multi-process strategy (single runs on 1; a mesh shape "
                   "must have this many ranks when it is given) (default: 2)")
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file (default: the built-in quick config)")
    p.add_argument("--out", default="runs/compare", metavar="DIR",
                   help="directory for the runs, compare.csv and compare.json")
    p.add_argument("--verify", action="store_true",
                   help="check per-step losses and final parameters against `single`")
    p.add_argument("--tolerance", type=number(0, "--tolerance 1e-5"), metavar="REL",
                   help="with --verify: largest relative deviation allowed, a fraction "
                   "(default: 1e-05)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides applied to every strategy")
    p.set_defaults(func=compare)

    p = sub.add_parser("sweep", help="run every combination of a matrix, locally or on SLURM")
    p.add_argument("spec", help="sweep spec YAML: base config, overrides, matrix (docs/sweeps.md)")
    p.add_argument("--launcher", choices=["local", "slurm"], default="local",
                   help="where the runs go: this machine, one after another, or SLURM jobs")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--out", metavar="DIR", help="output directory (default: sweeps/<spec name>)")
    p.add_argument("--timeout", type=number(0, "--timeout 900", inclusive=False),
                   metavar="SECONDS", help="wall-clock limit per run, in seconds "
                   "(default: the spec's timeout_s, 1800)")
    p.add_argument("--requeue", action="store_true",
                   help="SLURM: a job stopped by SIGTERM (preemption, scontrol requeue) or by "
                        "run.checkpoint_signal saves a checkpoint and is requeued; it resumes there")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("collect", help="one CSV row per run found under the directories")
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="directories of sweeps, compares or logs with [METRIC] lines")
    p.add_argument("-o", "--output", default="results.csv", metavar="CSV",
                   help="CSV file to write")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("plot", help="scaling, memory and accuracy figures from results.csv")
    p.add_argument("results", metavar="RESULTS_CSV", help="CSV written by `dtlab collect`")
    p.add_argument("comm", nargs="*", metavar="COMM_CSV",
                   help="collective-benchmark CSVs written by `dtlab comm --csv` (default: none)")
    p.add_argument("-o", "--output", default="plots", metavar="DIR",
                   help="directory for the PNG and SVG figures and index.json")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="one self-contained report.html (a sweep or compare: "
                       "with results.csv and plots)")
    p.add_argument("dir", metavar="DIR", help="DIR: a sweep, a compare, or one run directory")
    p.add_argument("-o", "--output", metavar="HTML", help="report file (default: DIR/report.html)")
    p.add_argument("--comm", nargs="*", default=[], metavar="COMM_CSV",
                   help="collective-benchmark CSVs written by `dtlab comm --csv`")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("comm", help="collective benchmarks (nccl-tests format) and cost model")
    from dtlab.comm.cli import add_comm_arguments, run_comm

    add_comm_arguments(p)
    p.set_defaults(func=run_comm)

    p = sub.add_parser("export", help="a checkpoint's full model as one safetensors file, or "
                       "as a directory Hugging Face transformers loads (--format hf)")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory, "
                   "RUN_DIR/checkpoints/step_NNNNNN")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                   help="safetensors: one file, dtlab's parameter names; hf: a new directory "
                   "with config.json and weights in the Hugging Face layout (model.name=gpt: "
                   "GPT2LMHeadModel)")
    p.add_argument("-o", "--output", metavar="PATH", help="the file to write (default: "
                   "model.safetensors); with --format hf the directory (default: hf-model)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="with --format hf: largest weight "
                   "file, e.g. 500MB, 2GB, 4GiB; above it the weights are split into "
                   "model-0000i-of-0000N.safetensors and an index (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace -o even when it is not an "
                   "earlier export of the same format (an earlier one is replaced without it)")
    p.set_defaults(func=cmd_export)

    from dtlab.estimate.cli import add_advise_arguments, add_estimate_arguments, cmd_estimate
    from dtlab.predict.advise_time import cmd_advise
    from dtlab.predict.cli import add_predict_arguments, cmd_predict
    from dtlab.text.cli import add_prepare_arguments, add_sample_arguments, cmd_prepare, cmd_sample

    for name, text, add_arguments, func in (  # commands whose arguments live beside them
        ("estimate", "per-rank memory and communication of a setup, by arithmetic",
         add_estimate_arguments, cmd_estimate),
        ("advise", "which strategy fits a GPU's memory, with the numbers and headroom",
         add_advise_arguments, cmd_advise),
        ("predict", "step time, throughput and MFU of each strategy at any world size",
         add_predict_arguments, cmd_predict),
        ("prepare", "text files -> train.bin/val.bin token data (data.name=tokens)",
         add_prepare_arguments, cmd_prepare),
        ("sample", "generate text from a trained GPT run or checkpoint", add_sample_arguments,
         cmd_sample)):
        p = sub.add_parser(name, help=text)
        add_arguments(p)
        p.set_defaults(func=func)

    p = sub.add_parser("config", help="print the resolved config (or --keys: every valid key)")
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file (default: the built-in quick config)")
    p.add_argument("--keys", action="store_true", help="list every valid dotted key instead")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("doctor", help="check torch, backends, devices, environment, network and "
                       "a 2-rank collective; each problem with its cause and fix (exit 1 on failure)")
    p.add_argument("check", nargs="?", choices=["hang"],
                   help="hang RUN_DIR: which rank stopped at which collective, from the "
                   "flight-recorder dumps of a failed or stopped run")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--nproc-per-node", type=integer(1, "--nproc-per-node 2"), metavar="N",
                   help="ranks per node to check for (default: LOCAL_WORLD_SIZE, else one per "
                   "GPU, else 2)")
    p.add_argument("--timeout", type=number(0, "--timeout 60", inclusive=False), default=60.0,
                   metavar="SECONDS", help="seconds before the collective smoke test's ranks "
                   "are killed")
    p.add_argument("--no-smoke", action="store_true", help="skip the collective smoke test")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A signal stops every process of the command with one line and exit code 128 + the signal
    # number (dtlab/process/interrupt.py; docs/reliability.md#signals). A `--json` answer owns
    # stdout: whatever else is printed meanwhile goes to stderr (`dtlab comm --json FILE` names a
    # file, not this flag).
    # Once the code is known, a signal ends the process at once (early_exit.finishing): marked
    # while the handlers are still ours, so that no moment is left for a KeyboardInterrupt.
    with handling(), stdout_kept_for_result(getattr(args, "json", None) is True):
        try:
            code = _command(args)
            finishing(code)
        except Interrupted as e:  # the signal came as the command returned
            code = report(e)
            finishing(code)
        return code


def _command(args: argparse.Namespace) -> int:
    try:
        code = args.func(args)
    except DtlabError as e:
        print(f"dtlab: error: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        return report(e)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except Exception:
        stop = lost()  # a stop whose Interrupted a library dropped: what broke next is its doing
        if stop is None:
            raise
        return report(stop)
    stop = lost()
    return report(stop) if stop is not None and code == 0 else code


def entry() -> NoReturn:
    """main(), then exit as distributed.leave() says when this process ran a process group (a
    1-rank run trains in this process). The `dtlab` command and `python -m dtlab` start in
    dtlab/__main__.py, which handles signals before this module's imports."""
    code = main()
    if "dtlab.distributed" in sys.modules:  # imported only by runs that may hold a group
        sys.modules["dtlab.distributed"].leave(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
