"""`dtlab comm`: launch the benchmark on N local ranks, or fit and query the cost model.

    dtlab comm --op all --nproc-per-node 4 --check --json comm.json --csv comm.csv
    dtlab comm --fit comm.json --predict all_reduce:64M:8 all_gather:1G:16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dtlab.errors import DtlabError


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    # Importing bench pulls in torch; the parser needs only its argument definitions.
    from dtlab.comm.bench import add_arguments

    add_arguments(p)
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N")
    p.add_argument("--fit", metavar="RESULTS", help="fit the alpha-beta model to a --json file")
    p.add_argument("--predict", nargs="*", default=[], metavar="OP:SIZE:RANKS",
                   help="with --fit: predicted times, e.g. all_reduce:64M:8")


def run_comm(args: argparse.Namespace) -> int:
    if args.fit:
        return fit_and_predict(Path(args.fit), args.predict)
    from dtlab.comm.bench import validate

    validate(args)
    forwarded = []
    for name in ("op", "min_bytes", "max_bytes", "factor", "dtype", "iters", "warmup", "p2p_bytes",
                 "timeout", "device", "backend", "corrupt_rank"):
        forwarded += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    forwarded += ["--check"] * args.check + ["--p2p"] * args.p2p
    forwarded += ["--json", str(Path(args.json).resolve())] if args.json else []
    forwarded += ["--csv", str(Path(args.csv).resolve())] if args.csv else []
    if args.nproc_per_node < 1:
        raise DtlabError("--nproc-per-node must be at least 1")
    if args.nproc_per_node == 1:
        from dtlab.comm.bench import main

        return main(forwarded)
    from dtlab.launch import launch

    return launch(forwarded, args.nproc_per_node, module="dtlab.comm.bench")


def fit_and_predict(path: Path, queries: list[str]) -> int:
    from dtlab.comm.bench import parse_size
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
