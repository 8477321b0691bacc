"""`dtlab advise --cluster`: the strategies that fit, ranked by their predicted step time.

advise (estimate/advise.py) finds the ideal layouts whose memory fits a GPU; each dtlab strategy
names the layout it is (its description's `textbook`: ddp, zero1, zero3), so the strategies of
the layouts that fit, without offload, are predicted on the cluster (core.py) and ranked.
"""

from __future__ import annotations

import argparse
from typing import Any

from dtlab.config.strategies import registry
from dtlab.errors import ConfigError, DtlabError


def ranked(args: argparse.Namespace, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The predicted rows of the fitting layouts' strategies, fastest first, with `slower`
    (step time over the fastest's)."""
    from dtlab.predict.cluster import load_cluster
    from dtlab.predict.core import Request, predict

    fitting = {r["strategy"] for r in result["candidates"] if r["fits"]}
    tokens = [s.name for s in registry.SPECS.values() if s.textbook in fitting and not s.one_process]
    cluster = load_cluster(args.cluster)
    per_node = args.ranks_per_node or min(args.gpus, cluster.gpus_per_node)
    req = Request(args.config, list(args.overrides), args.gpus, per_node, cluster)
    rows = []
    for token in tokens:
        try:
            rows.append(predict(req, token))
        except ConfigError as e:  # a strategy this world cannot take: said, not ranked
            rows.append({"strategy": token, "step_s": None, "why": str(e)})
    timed = sorted((r for r in rows if r["step_s"]), key=lambda r: r["step_s"])
    for r in timed:
        r["slower"] = r["step_s"] / timed[0]["step_s"]
    return timed + [r for r in rows if not r["step_s"]]


def cmd_advise(args: argparse.Namespace) -> int:
    from dtlab.estimate.cli import advise_result
    from dtlab.estimate.cli import cmd_advise as memory_advice
    from dtlab.predict.cli import ms
    from dtlab.predict.core import CLOSE_CALL, CLOSE_CALL_WHY

    if args.cluster is None:
        return memory_advice(args)
    if not args.config:
        raise DtlabError("--cluster ranks dtlab strategies of a config by step time; fix: add "
                         "--config FILE, or drop --cluster")
    rows = ranked(args, advise_result(args)[1])
    keep = ("strategy", "step_s", "slower", "samples_per_s", "mfu", "why")
    if args.json:
        return memory_advice(args, {"by_step_time": [{k: r.get(k) for k in keep} for r in rows],
                                    "cluster": args.cluster})
    memory_advice(args)
    print(f"by predicted step time on {args.cluster} (dtlab predict, the config's own settings):")
    close = False
    for r in rows:
        close |= 1 < r.get("slower", 0) < CLOSE_CALL
        print(f"  {r['strategy']}: " + (f"{ms(r['step_s'])} ms per step"
              + (" (fastest)" if r["slower"] == 1 else f", {r['slower']:.2f}x the fastest")
              if r["step_s"] else f"not ranked: {r['why']}"))
    if close:
        print(f"  (the fastest and those within {CLOSE_CALL}x of it: {CLOSE_CALL_WHY})")
    return 0
