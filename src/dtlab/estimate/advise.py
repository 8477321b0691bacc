"""`dtlab advise`: the cheapest data-parallel layout whose per-GPU memory fits, and its headroom.

Candidates, cheapest communication first (CANDIDATES); the first that fits is the advice. If none
does: when zero3's state alone exceeds the memory, only offload or more GPUs help (tensor and
pipeline parallelism divide the same state over the same GPUs); else the activations are the
problem, and tensor (or pipeline) parallelism of degree t divides them, and the gathered units, by
about t.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dtlab.estimate.core import Setup, estimate
from dtlab.estimate.memory import Kind

DDP, ZERO3_OFFLOAD = Kind.REPLICATED.value, f"{Kind.ZERO3}+offload"
CANDIDATES = [  # (strategy, activation checkpointing)
    *((k.value, False) for k in Kind), (Kind.ZERO3.value, True),
    (ZERO3_OFFLOAD, False), (ZERO3_OFFLOAD, True),
]
WHY = {
    Kind.REPLICATED: "a full replica per GPU: the least communication (gradients all-reduced)",
    Kind.ZERO1: "optimizer state sharded: the same communication volume as ddp",
    Kind.ZERO2: "gradients and optimizer state sharded: the same communication volume as ddp",
    Kind.ZERO3: "everything sharded: 1.5x ddp's communication (parameters gathered twice per step)",
    ZERO3_OFFLOAD: "sharded state in host memory: the optimizer steps on the CPU, shards cross PCIe",
}


def advise(make_setup: Callable[[bool], Setup], gpu_bytes: float, reserve: float = 0.0,
           host_bytes: float | None = None) -> dict[str, Any]:
    """`make_setup(checkpointing)` -> the setup to estimate. Returns candidates and advice."""
    rows = []
    for token, ckpt in CANDIDATES:
        setup = make_setup(ckpt)
        if setup.world == 1 and token != DDP:
            continue
        row = estimate(setup, token)
        need = row["device_total"] + reserve
        row.update(checkpointing=ckpt, fits=need <= gpu_bytes, headroom=gpu_bytes - need)
        if host_bytes is not None and row["host"]:
            row["host_per_node"] = row["host"] * setup.ranks_per_node
            row["host_fits"] = row["host_per_node"] <= host_bytes
            row["fits"] = row["fits"] and row["host_fits"]
        rows.append(row)
    chosen = next((r for r in rows if r["fits"]), None)
    advice = beyond_data_parallel(rows, gpu_bytes - reserve, make_setup(False)) if chosen is None \
        else {"strategy": chosen["strategy"], "checkpointing": chosen["checkpointing"],
              "per_gpu_bytes": chosen["device_total"], "headroom_bytes": chosen["headroom"],
              "why": WHY[chosen["strategy"]] + ("" if "activations" in chosen else "; activations "
                     "NOT included (not modelled for this model): measure a step before relying on it")}
    return {"candidates": rows, "gpu_bytes": gpu_bytes, "reserve": reserve, "recommendation": advice}


def beyond_data_parallel(rows: list[dict[str, Any]], budget: float, setup: Setup) -> dict[str, Any]:
    """No data-parallel layout fits: more GPUs, or model parallelism for the activations."""
    zero3 = next((r for r in rows if r["strategy"] == "zero3" and r["checkpointing"]), None)
    if zero3 is None:  # one GPU: nothing to shard over, so only ddp was estimated
        return {"strategy": None, "model_parallel": None, "gpus_needed": None,
                "why": f"one GPU holds the whole model, its state and activations "
                       f"({rows[0]['device_total'] / 1e9:.2f} GB); no layout shards anything "
                       "over one GPU: give --gpus 2 or more to see the sharded layouts"}
    state = zero3["state"]
    rest = zero3["device_total"] - state  # activations and gathered units
    if state >= budget:
        # State per GPU is 1/n of the total; activations and units stay per GPU.
        room = budget - rest
        gpus = math.ceil(state * setup.world / room) if room > 0 else None
        return {"strategy": None, "model_parallel": None, "gpus_needed": gpus,
                "why": "zero3's sharded state alone exceeds the memory per GPU; tensor and "
                       "pipeline parallelism divide the same state over the same GPUs, so only "
                       "more GPUs (or a larger host for offload) help"}
    degree = 2
    while degree <= setup.ranks_per_node and state + rest / degree > budget:
        degree *= 2
    if degree > setup.ranks_per_node:
        return {"strategy": None, "model_parallel": None, "gpus_needed": None,
                "why": "activations exceed the memory even divided over a whole node by tensor "
                       "parallelism; use a smaller micro batch or sequence length"}
    return {"strategy": "zero3", "checkpointing": True, "model_parallel": degree,
            "per_gpu_bytes": state + rest / degree, "headroom_bytes": budget - state - rest / degree,
            "why": f"state fits but activations do not: tensor (or pipeline) parallelism of "
                   f"degree {degree} inside a node divides activations and gathered units by "
                   f"about {degree}"}
