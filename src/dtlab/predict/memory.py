"""The memory of a predicted row: `dtlab estimate`'s bytes per rank at the peak, or the state
the traced wrappers held where the estimate cannot tell."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from dtlab.config.strategies import registry
from dtlab.predict.events import Trace

if TYPE_CHECKING:
    from dtlab.predict.core import Request

STATE_ONLY = "state only"  # a memory that leaves out activations: its fit is marked so


def memory(req: Request, token: str, traces: dict[int, Trace], notes: list[str]) -> dict[str, Any]:
    """`dtlab estimate`'s bytes per rank at the peak (state, temporaries, activations), or where
    it cannot tell (tensor or pipeline parallelism of a model too large to measure there), the
    state the trace's own wrappers held: parameters, gradients, optimizer state, no activations."""
    from dtlab.config.device import backend_type
    from dtlab.errors import DtlabError
    from dtlab.estimate import core
    from dtlab.estimate.cli import config_batch, config_checkpointing

    overrides = [*req.overrides, *registry.parse(token)]  # the token's batch split, not the file's
    model = core.model_from_config(req.path, overrides)
    args = argparse.Namespace(config=req.path, overrides=overrides, micro_batch=None)
    micro, cfg = config_batch(args, model, req.world, req.ranks_per_node)
    setup = core.Setup(model, req.world, req.ranks_per_node, core.precision_of(cfg),
                       core.optimizer_of(cfg), micro, config_checkpointing(model), None,
                       backend_type(cfg))
    try:
        row = core.estimate(setup, token)
    except DtlabError as e:
        held = [t.meta["state_bytes"] for t in traces.values() if "state_bytes" in t.meta]
        if not held:
            raise
        state = max(sum(h.values()) for h in held)
        notes.append(f"memory: the state the traced wrappers held ({state / 1e9:.2f} GB), "
                     f"activations and temporaries not included (the estimate: {e})")
        return {"device_bytes": state, "host_bytes": 0, "source": STATE_ONLY,
                "exact": False}
    if "activations" not in row:  # tp, pp, hf models: the estimate holds the state alone
        notes.append("memory: the state alone; activations and temporaries not modelled here")
        return {"device_bytes": row["device_total"], "host_bytes": row["host"],
                "source": STATE_ONLY, "exact": row["exact"]}
    notes.extend(n for n in row.get("notes", []) if n not in notes)
    return {"device_bytes": row["device_total"], "host_bytes": row["host"],
            "source": row["source"], "exact": row["exact"]}
