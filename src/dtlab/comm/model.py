"""The alpha-beta (latency-bandwidth) cost model, fitted to `dtlab comm` measurements.

A message of S bytes over one link costs alpha + S * beta. A collective on n ranks is a sequence
of such steps; for the ring algorithms (what NCCL and gloo use for large messages):

    all_reduce      reduce-scatter then all-gather: 2(n-1) steps of S/n bytes
                    t = 2(n-1) alpha + 2(n-1)/n S beta
    all_gather,     n-1 steps of S/n bytes (S = the total size)
    reduce_scatter, t = (n-1) alpha + (n-1)/n S beta
    all_to_all
    broadcast,      pipelined along the ring: t ~ (n-1) alpha + S beta
    reduce
    send_recv       t = alpha + S beta

and for trees (latency-bound small messages): all_reduce as reduce + broadcast over a binary tree,
t = 2 log2(n) (alpha + S beta); broadcast/reduce t = log2(n) (alpha + S beta); all_gather and
reduce_scatter by recursive doubling/halving, t = log2(n) alpha + (n-1)/n S beta.

A straight line t = a + b S is fitted to each collective's measured times with a >= 0 and b >= 0
(a latency or a time per byte below zero has no meaning), minimising the squared *relative*
residuals: sizes span several decades, and plain least squares would let the largest sizes decide
alone, leaving the latency to chance. Its quality: R^2 of log t (the same relative scale) and
the relative residuals. a and b are then divided by the formula's step counts to
give alpha and beta. A fit that cannot be trusted (too few sizes, time not growing with size,
noise) is kept with the reason and what to measure instead; `predict` refuses to use it.

Small messages need not follow the line: gloo's ring splits a buffer into one chunk per rank, and
a one-element all-reduce (a flag, a gradient norm) skips most of the ring's steps (on 4 CPU ranks
here: 0.7 ms against 4-8 ms for 16 bytes to 64 KiB, 2026-11-28). `fit(rows, line_from=BYTES)`
fits the line to the sizes from BYTES up and keeps the smaller sizes' measured times: `predict`
answers a size below BYTES on the measured number of ranks from those times (linear between the
two nearest, the line's value at BYTES the last), not from the line. Default 0: all on the line.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError

MIN_SIZES = 3  # two sizes fit any line exactly: a third is the first check of the model
MIN_R2 = 0.9  # the line must explain 90% of the variance of the (log) times
# The line more than 2x off a measured time (either way): the model does not describe that size
# (noise, or a change of protocol), and predictions near it would be off as much. The real
# curve bends (gloo on loopback: 30-45% off a straight line at 1-4 MiB on 2 ranks on one core,
# measured repeatedly), which a cost model of two numbers may be.
MAX_FACTOR_OFF = 2.0
# The slope is measured only where bytes take a visible part of the time: at the largest size
# b S must be at least half of the time (else b is a small difference of latencies, and a
# prediction for large messages extrapolates noise).
MIN_BANDWIDTH_SHARE = 0.5


class PoorFitError(DtlabError):
    """A prediction asked of a fit that cannot be trusted."""


def ring_terms(op: str, n: int) -> tuple[float, float]:
    """(number of alpha terms, factor on S beta) of the ring form."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n
    if op in ("broadcast", "reduce"):
        return n - 1, 1.0
    return 1, 1.0  # send_recv


def tree_terms(op: str, n: int) -> tuple[float, float]:
    steps = math.log2(n) if n > 1 else 0.0
    if op == "all_reduce":
        return 2 * steps, 2 * steps
    if op in ("broadcast", "reduce"):
        return steps, steps
    if op in ("all_gather", "reduce_scatter"):
        return steps, (n - 1) / n
    return ring_terms(op, n)  # all_to_all, send_recv: no tree form


def line_fit(s: list[float], t: list[float]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum(((t - a - b s) / t)^2): non-negative weighted least squares.

    With two parameters the constrained minimum is either the unconstrained one (when both are
    >= 0) or lies on a boundary (a = 0 or b = 0, each a one-parameter fit): try them all."""
    w = [1 / ti**2 for ti in t]
    sw, sws = sum(w), sum(wi * si for wi, si in zip(w, s, strict=True))
    sws2 = sum(wi * si * si for wi, si in zip(w, s, strict=True))
    swt = sum(wi * ti for wi, ti in zip(w, t, strict=True))
    swst = sum(wi * si * ti for wi, si, ti in zip(w, s, t, strict=True))

    def cost(a: float, b: float) -> float:
        return sum(wi * (ti - a - b * si) ** 2 for wi, si, ti in zip(w, s, t, strict=True))

    candidates = [(swt / sw, 0.0), (0.0, swst / sws2 if sws2 else 0.0)]
    det = sw * sws2 - sws * sws
    if det > 0:
        a, b = (swt * sws2 - sws * swst) / det, (sw * swst - sws * swt) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    return min(candidates, key=lambda ab: cost(*ab))


def size_text(nbytes: float) -> str:
    """8, 64K, 32M, 1G: the notation --min-bytes and --max-bytes take."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g}{unit}"
    return f"{nbytes:.0f}"


def refusal(n: int, sizes: list[float], a: float, b: float, r2: float,
            worst: tuple[float, float]) -> str | None:
    """Why predictions from this fit would mislead, and what to measure instead; None if fine."""
    if not sizes:
        return ("no valid time (each is zero, negative or not a number); fix: measure again "
                "with dtlab comm --json")
    span = f"from {size_text(min(sizes))} to {size_text(max(sizes))} bytes"
    larger = f"--max-bytes {size_text(max(64 << 20, 16 * max(sizes)))}"
    if n < 2:
        return "measured on 1 rank, where no message crosses a link; fix: measure on 2 or more ranks"
    if len(sizes) < MIN_SIZES:
        return (f"only {len(sizes)} message size(s) measured ({span}), a line needs "
                f"{MIN_SIZES} to be checked; fix: measure more sizes (e.g. --min-bytes 1K "
                "--max-bytes 64M --factor 4)")
    if b <= 0:
        return (f"the time does not grow with the message size {span}, so the bandwidth "
                f"is unknown; fix: measure larger messages ({larger})")
    share = b * max(sizes) / (a + b * max(sizes))
    if share < MIN_BANDWIDTH_SHARE:
        return (f"at the largest size ({size_text(max(sizes))} bytes) the bytes take "
                f"{100 * share:.0f}% of the time, latency the rest, so the bandwidth is not "
                f"measured; fix: measure larger messages ({larger})")
    if r2 < MIN_R2:
        explains = f"R^2 = {r2:.3f}" if r2 >= 0 else "none (R^2 below 0)"
        return (f"the line explains {explains} of the variance of the log times (need {MIN_R2}): "
                f"latency noise dominates; fix: measure larger messages ({larger}) and more "
                "iterations (--iters 50) on an otherwise idle machine")
    size, factor = worst
    if factor > MAX_FACTOR_OFF:
        return (f"the line is {factor:.1f}x off the time measured at {size_text(size)} bytes "
                f"(limit {MAX_FACTOR_OFF:g}x): noisy or not linear; fix: more iterations "
                "(--iters 50) on an otherwise idle machine, and more sizes (--factor 2)")
    return None


def log_r2(t: list[float], fitted: list[float]) -> float:
    """R^2 of the logarithms: the share of the variance of log t the line explains. Measured in
    the space the fit minimises (relative error), where 300 us and 30 ms weigh alike; 0 when
    the times do not vary or the line is not positive."""
    if not t or min(fitted) <= 0:
        return 0.0
    logs = [math.log(ti) for ti in t]
    mean = sum(logs) / len(logs)
    total = sum((x - mean) ** 2 for x in logs)
    resid = sum((x - math.log(fi)) ** 2 for x, fi in zip(logs, fitted, strict=True))
    return 1 - resid / total if total > 1e-12 else 0.0


def fit_op(op: str, pts: list[dict[str, Any]], line_from: float = 0.0) -> dict[str, Any]:
    n = int(pts[0]["world_size"])
    valid = [(float(p["size_bytes"]), float(p["time_us"]) * 1e-6) for p in pts
             if math.isfinite(float(p["time_us"])) and float(p["time_us"]) > 0]
    dropped = len(pts) - len(valid)  # a time of zero or less, or not a number: not a measurement
    below = _medians([v for v in valid if v[0] < line_from])
    valid = [v for v in valid if v[0] >= line_from]
    s, t = [v[0] for v in valid], [v[1] for v in valid]
    sizes = sorted(set(s))
    a, b = line_fit(s, t) if len(sizes) >= 2 else (sum(t) / len(t) if t else 0.0, 0.0)
    fitted = [a + b * si for si in s]
    r2 = log_r2(t, fitted)
    rel = [abs(ti - fi) / ti for ti, fi in zip(t, fitted, strict=True)]
    off = [max(fi / ti, ti / fi) if fi > 0 else math.inf for ti, fi in zip(t, fitted, strict=True)]
    worst = max(zip(off, s, strict=True), default=(1.0, 0.0))
    k_alpha, k_beta = ring_terms(op, n)
    return {"world_size": n, "points": len(valid), "sizes": len(sizes), "dropped_points": dropped,
            "min_bytes": min(s, default=0.0), "max_bytes": max(s, default=0.0),
            "a_s": a, "b_s_per_byte": b, "r2": r2,
            "median_rel_residual": sorted(rel)[len(rel) // 2] if rel else 0.0,
            "max_rel_residual": max(rel, default=0.0), "max_factor_off": worst[0],
            "alpha_s": a / k_alpha if k_alpha else a,
            "beta_s_per_byte": b / k_beta if k_beta else b,
            "refused": refusal(n, sizes, a, b, r2, (worst[1], worst[0])),
            "line_from": line_from, "below_line": below}


def _medians(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(size, median time) per measured size, by size."""
    by_size: dict[float, list[float]] = {}
    for size, t in points:
        by_size.setdefault(size, []).append(t)
    return [(size, sorted(ts)[len(ts) // 2]) for size, ts in sorted(by_size.items())]


def fit(rows: list[dict[str, Any]], line_from: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per collective: a, b of t = a + b S (both >= 0) over the sizes from `line_from` bytes up,
    R^2, relative residuals, the ring-model alpha and beta, `refused`: why predictions would
    mislead (None when they would not), and `below_line`: the smaller sizes' measured times."""
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if isinstance(r, dict) and "size_bytes" in r and "time_us" in r:
            by_op.setdefault(r["op"], []).append(r)
    return {op: fit_op(op, pts, line_from) for op, pts in by_op.items()}


def fit_file(path: Path, line_from: float = 0.0) -> dict[str, dict[str, Any]]:
    """A `dtlab comm --json` or `--csv` file -> `fit` of its measurements. OSError, ValueError
    (a binary file's UnicodeDecodeError too), KeyError, TypeError or ArithmeticError when it is
    not one: the caller names the file and the fix."""
    text = Path(path).read_text()
    rows: Any = json.loads(text) if Path(path).suffix != ".csv" else [
        {"op": r["op"], "world_size": int(r["world_size"]), "size_bytes": float(r["size_bytes"]),
         "time_us": float(r["time_us"])} for r in csv.DictReader(text.splitlines())]
    if not isinstance(rows, list) or any(  # the fit divides by a measurement's ranks - 1
            isinstance(r, dict) and "time_us" in r and not (
                isinstance(r.get("world_size"), int) and r["world_size"] >= 2) for r in rows):
        raise ValueError(f"{path}: not a list of measurements on 2 ranks or more")
    return fit(rows, line_from)


def predict(model: dict[str, dict[str, Any]], op: str, size_bytes: float, n: int) -> dict[str, float]:
    """Time (s) of `op` on S bytes and n ranks, ring and tree forms, from that op's fit (or the
    all_reduce fit when the op was not measured); below the fit's `line_from` on the ranks it
    measured, its measured times (module docstring). PoorFitError when that fit was refused."""
    if not (n >= 1 and math.isfinite(size_bytes) and size_bytes >= 0):
        raise ValueError(f"{size_bytes:g} bytes on {n} ranks is not a collective (ranks >= 1, "
                         "bytes >= 0)")
    name = op if op in model else "all_reduce"
    params = model.get(name)
    if params is None:
        raise KeyError(f"no fit for {op} (nor all_reduce) in the measurements")
    if params.get("refused"):
        raise PoorFitError(f"no prediction for {op} from the {name} fit: {params['refused']}")
    if name == op and n == params["world_size"] and params.get("below_line") \
            and size_bytes < params["line_from"]:
        t = _between(params, size_bytes)
        return {"ring_s": t, "tree_s": t}
    alpha, beta = params["alpha_s"], params["beta_s_per_byte"]
    ring_a, ring_b = ring_terms(op, n)
    tree_a, tree_b = tree_terms(op, n)
    return {"ring_s": ring_a * alpha + ring_b * size_bytes * beta,
            "tree_s": tree_a * alpha + tree_b * size_bytes * beta}


def _between(params: dict[str, Any], size: float) -> float:
    """The measured time of `size` bytes below the line: linear between the two nearest
    measured sizes (the line's value at `line_from` above the largest), the smallest's below."""
    start = params["line_from"]
    points = [*params["below_line"], (start, params["a_s"] + params["b_s_per_byte"] * start)]
    i = bisect.bisect_left([s for s, _ in points], size)  # size < start: i < len(points)
    if i == 0:
        return points[0][1]
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (size - s0) / (s1 - s0)


def _bandwidth(seconds_per_byte: float) -> str:
    return f"{1 / seconds_per_byte / 1e9:.3f}" if seconds_per_byte > 0 else "-"


def format_fit(model: dict[str, dict[str, Any]]) -> str:
    """The table of trusted fits, then one line per refused fit saying what to measure."""
    lines = ["# alpha-beta fit: t = a + b S per collective (a, b >= 0, least squares on relative "
             "error; R^2 of log t; max rel: the largest |t - fit| / t); alpha, beta of the ring model",
             f"# {'op':<15}{'ranks':>6}{'sizes':>6}{'a (us)':>10}{'1/b (GB/s)':>12}{'R^2':>8}"
             f"{'max rel':>9}{'alpha (us)':>12}{'1/beta (GB/s)':>15}"]
    for op, m in model.items():
        if m["refused"]:
            continue
        lines.append(f"  {op:<15}{m['world_size']:>6}{m['sizes']:>6}{m['a_s'] * 1e6:>10.1f}"
                     f"{_bandwidth(m['b_s_per_byte']):>12}{m['r2']:>8.4f}"
                     f"{100 * m['max_rel_residual']:>8.0f}%{m['alpha_s'] * 1e6:>12.1f}"
                     f"{_bandwidth(m['beta_s_per_byte']):>15}")
    lines += [f"# {op} ({m['world_size']} ranks): fit refused, no predictions: {m['refused']}"
              for op, m in model.items() if m["refused"]]
    return "\n".join(lines)
