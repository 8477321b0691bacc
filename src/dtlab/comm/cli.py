"""`dtlab comm`: launch the benchmark on N local ranks, or fit and query the cost model.

    dtlab comm --op all --nproc-per-node 4 --check --json comm.json --csv comm.csv
    dtlab comm --fit comm.json --predict all_reduce:64M:8 all_gather:1G:16
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dtlab.atomic_write import check_replaceable
from dtlab.cli_args import input_file, integer, output_file
from dtlab.comm.arguments import OPS, add_arguments, parse_size, validate
from dtlab.errors import DtlabError
from dtlab.files import meminfo

# The benchmark's own options (dtlab/comm/bench.py) as `dtlab comm --help` explains them.
HELP = {
    "op": "collective to measure, or all of them",
    "min_bytes": "smallest message size in bytes (K, M, G: binary multiples)",
    "max_bytes": "largest message size in bytes (K, M, G: binary multiples; default: 32M)",
    "factor": "size multiplier between two measured sizes, above 1",
    "dtype": "element type of the messages",
    "iters": "timed repetitions per size",
    "warmup": "untimed repetitions per size before the timed ones",
    "check": "verify every element of every result",
    "p2p": "also measure every pair of ranks",
    "p2p_bytes": "message size of the pairwise measurement in bytes (default: 16M)",
    "json": "write every measurement to this JSON file (the input of --fit)",
    "csv": "write one row per op and size to this CSV file (for dtlab plot)",
    "timeout": "process-group timeout in seconds",
    "device": "where the messages live: cpu, cuda, or auto (cuda when present)",
    "backend": "process-group backend: gloo, nccl, or auto (nccl on cuda)",
}
METAVARS = {"min_bytes": "BYTES", "max_bytes": "BYTES", "p2p_bytes": "BYTES", "factor": "X",
            "iters": "N", "warmup": "N", "json": "FILE", "csv": "FILE", "timeout": "SECONDS"}
MEASURING = ("json", "csv", "check", "p2p")  # options that only apply when measuring
MIN_TIMEOUT_S = 1.0  # below it the ranks' rendezvous times out (a traceback per rank)
MAX_SIZES = 1000  # message sizes in one sweep; --factor 2 from 8 B to 32M gives 23


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    for action in p._actions:
        if action.dest in HELP:
            action.help = HELP[action.dest]
            action.metavar = METAVARS.get(action.dest, action.metavar)
    p.add_argument("--nproc-per-node", type=integer(1, "--nproc-per-node 2"), default=2,
                   metavar="N", help="ranks to measure on, on this node")
    p.add_argument("--fit", metavar="RESULTS", help="instead of measuring: fit the alpha-beta "
                   "model to a file written by --json")
    p.add_argument("--predict", nargs="*", default=[], metavar="OP:SIZE:RANKS",
                   help="with --fit: predicted times, e.g. all_reduce:64M:8 (SIZE in bytes, "
                   "K/M/G suffixes) (default: none)")


def check_arguments(args: argparse.Namespace) -> None:
    """Everything the measurement or the fit will need, before either starts."""
    if args.predict and not args.fit:
        raise DtlabError("--predict needs --fit RESULTS (a file written by --json); fix: add "
                         "--fit comm.json, or measure first with --json comm.json")
    for q in args.predict:
        fix = "; fix: write OP:SIZE:RANKS, e.g. all_reduce:64M:8"
        parts = q.split(":")
        if len(parts) != 3:
            raise DtlabError(f"--predict '{q}' is not OP:SIZE:RANKS{fix}")
        op, size, ranks = parts
        if op not in OPS:
            raise DtlabError(f"--predict '{q}': unknown collective '{op}'; fix: use one of "
                             f"{', '.join(OPS)}")
        try:
            parse_size(size)
        except argparse.ArgumentTypeError as e:
            raise DtlabError(f"--predict '{q}': {e}{fix}") from None
        if not ranks.isdigit() or int(ranks) < 1:
            raise DtlabError(f"--predict '{q}': ranks '{ranks}' is not a whole number of at "
                             f"least 1{fix}")
    if args.fit:
        given = [f"--{k.replace('_', '-')}" for k in MEASURING if getattr(args, k)]
        if given:
            raise DtlabError(f"{' '.join(given)} apply to a measurement, not to --fit; fix: "
                             "remove them, or drop --fit to measure")
        path = input_file("--fit", args.fit, f"measure first with dtlab comm --json {args.fit}")
        try:
            rows = json.loads(path.read_bytes().decode())
        except ValueError:
            rows = None
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise DtlabError(f"--fit '{path}' is not a dtlab comm --json file (a list of "
                             f"measurements); fix: measure with dtlab comm --json {path}")
        return
    for flag, value, low, example in (("--factor", args.factor, 1, 2), ("--timeout", args.timeout,
                                                                        0, 300)):
        if not math.isfinite(value) or value <= low:
            raise DtlabError(f"{flag} {value:g} is not a finite number above {low}; fix: e.g. "
                             f"{flag} {example}")
    if args.timeout < MIN_TIMEOUT_S:
        raise DtlabError(f"--timeout {args.timeout:g} is shorter than the ranks take to meet "
                         f"(their rendezvous alone); fix: at least {MIN_TIMEOUT_S}, e.g. "
                         "--timeout 300")
    if args.iters < 1 or args.warmup < 0:
        raise DtlabError(f"--iters {args.iters} --warmup {args.warmup}: at least 1 timed and 0 "
                         "untimed repetitions; fix: e.g. --iters 20 --warmup 5")
    if args.min_bytes > args.max_bytes:
        raise DtlabError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}; "
                         "fix: swap them, or e.g. --min-bytes 8 --max-bytes 32M")
    validate(args)
    n_sizes, size = 0, args.min_bytes
    while size <= args.max_bytes and n_sizes <= MAX_SIZES:  # as bench.sizes steps
        n_sizes, size = n_sizes + 1, max(int(size * args.factor), size + 1)
    if n_sizes > MAX_SIZES:
        raise DtlabError(f"--factor {args.factor:g} from {args.min_bytes} to {args.max_bytes} "
                         f"bytes makes more than {MAX_SIZES} message sizes (hours of measuring); "
                         "fix: a larger --factor, e.g. --factor 2, or a narrower --min-bytes/"
                         "--max-bytes range")
    _check_device(args)
    if args.json and args.csv and Path(args.json).resolve() == Path(args.csv).resolve():
        raise DtlabError(f"--json and --csv name the same file '{args.json}', and one would "
                         "replace the other; fix: give them different names, e.g. --json comm.json "
                         "--csv comm.csv")
    for flag, path in (("--json", args.json), ("--csv", args.csv)):
        if path:
            output_file(flag, path, f"comm.{flag[2:]}")
            _check_replaceable(flag, Path(path))


def _check_device(args: argparse.Namespace) -> None:
    """--device cuda or --backend nccl on a machine without CUDA: one line here, in the flags'
    own names, instead of one per rank naming run.device."""
    import torch

    asked = [f for f, v in (("--device cuda", args.device == "cuda"),
                            ("--backend nccl", args.backend == "nccl")) if v]
    if asked and not torch.cuda.is_available():
        raise DtlabError(f"{' '.join(asked)} needs a CUDA device, and none is visible; fix: "
                         "--device cpu --backend gloo, or leave both at auto")
    if args.device == "cuda" or (args.device != "cpu" and torch.cuda.is_available()):
        return
    # On CPU every rank holds a message's input and output (and a check's copy) in this host's
    # memory: a size that cannot fit would end in an allocation failure gloo misreports.
    need, free = 3 * args.max_bytes * args.nproc_per_node, meminfo().get("MemAvailable")
    if free is not None and need > free:
        fits = 1 << max(3, int(free // (3 * args.nproc_per_node)).bit_length() - 1)
        raise DtlabError(f"--max-bytes {args.max_bytes} needs about {need / 2**30:.1f} GiB of "
                         f"host memory on {args.nproc_per_node} ranks (3 buffers each), and "
                         f"{free / 2**30:.1f} GiB is available; fix: --max-bytes {fits} or less")


def _check_replaceable(flag: str, path: Path) -> None:
    """Replace only an earlier --json/--csv (or an empty file): a file of the user's is kept."""
    def earlier(head: bytes) -> bool:
        head = head[:64].lstrip()
        return head.startswith(b"[") and b'"op"' in head if flag == "--json" else \
            head.startswith(b"op,")

    check_replaceable(path, f"an earlier dtlab comm {flag} file", earlier,
                      f"give {flag} another file name", flag)


def run_comm(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.fit:
        return fit_and_predict(Path(args.fit), args.predict)
    forwarded = []
    for name in ("op", "min_bytes", "max_bytes", "factor", "dtype", "iters", "warmup", "p2p_bytes",
                 "timeout", "device", "backend", "corrupt_rank"):
        forwarded += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    forwarded += ["--check"] * args.check + ["--p2p"] * args.p2p
    forwarded += ["--json", str(Path(args.json).resolve())] if args.json else []
    forwarded += ["--csv", str(Path(args.csv).resolve())] if args.csv else []
    if args.nproc_per_node == 1:
        from dtlab.comm.bench import main

        return main(forwarded)
    from dtlab.process.launch import launch

    return launch(forwarded, args.nproc_per_node, module="dtlab.comm.bench")


def fit_and_predict(path: Path, queries: list[str]) -> int:
    from dtlab.comm.model import PoorFitError, fit, format_fit, predict

    if not path.is_file():
        raise DtlabError(f"'{path}' not found; fix: measure first with dtlab comm --json {path}")
    try:
        rows = json.loads(path.read_text())
        model = fit(rows) if isinstance(rows, list) else {}
    except (ValueError, TypeError, KeyError):
        raise DtlabError(f"'{path}' is not a dtlab comm --json file") from None
    if not model:
        raise DtlabError(f"'{path}' has no collective timings; fix: measure with dtlab comm "
                         f"--json {path}")
    print(format_fit(model))
    timing = next((r for r in rows if isinstance(r, dict) and r.get("op") == "timing"), {})
    if timing.get("unreliable"):
        print(f"# WARN: measured with unreliable timings ({'; '.join(timing['unreliable'])}): "
              "the fit describes that machine state")
    for q in queries:
        try:
            op, size, ranks = q.split(":")
            s, n = parse_size(size), int(ranks)
            t = predict(model, op, s, n)
        except (ValueError, KeyError, argparse.ArgumentTypeError) as e:
            raise DtlabError(f"--predict '{q}': {e}; fix: write OP:SIZE:RANKS, e.g. all_reduce:64M:8") from None
        except PoorFitError as e:
            raise PoorFitError(f"--predict '{q}': {e}") from None
        print(f"  {op} of {s} B on {n} ranks: ring {t['ring_s'] * 1e3:.3f} ms, "
              f"tree {t['tree_s'] * 1e3:.3f} ms")
    return 0
