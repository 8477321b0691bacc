"""`dtlab predict --tokens N [--gpu-hour-cost USD]`: how long, and what it costs, to train N
tokens at each row's predicted speed (its global tokens per second on --world-size GPUs)."""

from __future__ import annotations

import re
from typing import Any

from dtlab.errors import DtlabError

SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def token_count(text: str) -> float:
    """'15T', '2.5B', '300M', '1e12' or '1000000' tokens; one line naming the fix otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([kKmMbBgGtT]?)\s*", text)
    value = float(m.group(1)) * SCALE[m.group(2).lower()] if m else 0.0
    if value < 1:
        raise DtlabError(f"--tokens '{text}' is not a number of tokens; fix: e.g. --tokens 15T "
                         "(K, M, B or T: thousand, million, billion, trillion), or 1e12")
    return value


def add_to_train(rows: list[dict[str, Any]], tokens: float, gpu_hour_cost: float | None) -> None:
    """Each row's `to_train`: days, GPU-hours (and their cost) for `tokens` at its speed."""
    for r in rows:
        if not r.get("tokens_per_s"):
            raise DtlabError(f"--tokens: {r['strategy']}'s model does not train on tokens (its "
                             "samples are images); fix: drop --tokens, or a language model "
                             "(model.name=gpt or hf)")
        seconds = tokens / r["tokens_per_s"]
        hours = seconds / 3600 * r["world_size"]
        r["to_train"] = {"tokens": tokens, "days": seconds / 86400, "gpu_hours": hours,
                         **({"cost": hours * gpu_hour_cost, "gpu_hour_cost": gpu_hour_cost}
                            if gpu_hour_cost is not None else {})}


def columns(r: dict[str, Any]) -> dict[str, str]:
    """The table's columns of a row's `to_train` (none without --tokens)."""
    t = r.get("to_train")
    if t is None:
        return {}
    days = f"{t['days']:,.0f}" if t["days"] >= 100 else f"{t['days']:.3g}"
    out = {"days": days, "GPU-h": f"{t['gpu_hours']:,.0f}"}
    if "cost" in t:
        out["cost"] = f"{t['cost']:,.0f}"
    return out
