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

A straight line t = a + b S is fitted to each collective's measured times (least squares, R^2
reported); a and b are then divided by the formula's step counts to give alpha and beta.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


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


def fit(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per collective: a, b of t = a + b S, R^2, and the ring-model alpha and beta."""
    out = {}
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "size_bytes" in r and "time_us" in r:
            by_op.setdefault(r["op"], []).append(r)
    for op, pts in by_op.items():
        if len({p["size_bytes"] for p in pts}) < 2:
            continue
        n = int(pts[0]["world_size"])
        s = np.array([p["size_bytes"] for p in pts], dtype=float)
        t = np.array([p["time_us"] for p in pts], dtype=float) * 1e-6
        b, a = np.polyfit(s, t, 1)
        resid = t - (a + b * s)
        r2 = 1 - float((resid**2).sum()) / float(((t - t.mean()) ** 2).sum() or 1.0)
        k_alpha, k_beta = ring_terms(op, n)
        out[op] = {"world_size": n, "points": len(pts), "a_s": float(a), "b_s_per_byte": float(b),
                   "r2": r2, "alpha_s": float(a) / k_alpha if k_alpha else float(a),
                   "beta_s_per_byte": float(b) / k_beta}
    return out


def predict(model: dict[str, dict[str, float]], op: str, size_bytes: float, n: int) -> dict[str, float]:
    """Time (s) of `op` on S bytes and n ranks, ring and tree forms, from that op's fit (or the
    all_reduce fit when the op was not measured)."""
    params = model.get(op) or model.get("all_reduce")
    if params is None:
        raise KeyError(f"no fit for {op} (nor all_reduce) in the measurements")
    alpha, beta = params["alpha_s"], params["beta_s_per_byte"]
    ring_a, ring_b = ring_terms(op, n)
    tree_a, tree_b = tree_terms(op, n)
    return {"ring_s": ring_a * alpha + ring_b * size_bytes * beta,
            "tree_s": tree_a * alpha + tree_b * size_bytes * beta}


def format_fit(model: dict[str, dict[str, float]]) -> str:
    lines = ["# alpha-beta fit: t = a + b S per collective; alpha, beta of the ring model",
             f"# {'op':<15}{'ranks':>6}{'points':>7}{'a (us)':>10}{'1/b (GB/s)':>12}{'R^2':>8}"
             f"{'alpha (us)':>12}{'1/beta (GB/s)':>15}"]
    for op, m in model.items():
        inv_b = 1 / m["b_s_per_byte"] / 1e9 if m["b_s_per_byte"] > 0 else float("inf")
        inv_beta = 1 / m["beta_s_per_byte"] / 1e9 if m["beta_s_per_byte"] > 0 else float("inf")
        lines.append(f"  {op:<15}{m['world_size']:>6}{m['points']:>7}{m['a_s'] * 1e6:>10.1f}"
                     f"{inv_b:>12.3f}{m['r2']:>8.4f}{m['alpha_s'] * 1e6:>12.1f}{inv_beta:>15.3f}")
    return "\n".join(lines)
