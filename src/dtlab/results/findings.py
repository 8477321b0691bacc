"""Sentences computed from the results: what a reader should take away, with the numbers."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from dtlab.config.strategies import registry

MiB = 1024 * 1024


def _num(r: dict[str, Any], key: str) -> float | None:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _rest(r: dict[str, Any]) -> str:
    """What else the run varied besides the strategy ("" when nothing)."""
    return str(r.get("series") or "").partition(", ")[2]


def _shards(r: dict[str, Any]) -> bool:
    spec = registry.spec_of_label(r.get("strategy") or "")
    return spec is not None and spec.shards_state


def _ranks(n: float) -> str:
    return f"{n:g} rank" + ("" if n == 1 else "s")


def _unreliable(r: dict[str, Any]) -> bool:
    """Timings measured under load or oversubscription (summary.json `timing`)."""
    return bool(r.get("unreliable"))


def _names(runs: list[dict[str, Any]]) -> str:
    return ", ".join(dict.fromkeys(str(r.get("series")) for r in runs))


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Memory and correctness findings from every finished run; throughput, scaling and speed
    comparisons only from runs whose timings are reliable (the others get a WARN instead)."""
    done = [r for r in rows if r.get("status") in (None, "done") and _num(r, "world_size")]
    out: list[str] = [f"WARN: {r['series']} at {_ranks(r['world_size'])}: timings unreliable "
                      f"({r['unreliable']}); its throughput is not compared."
                      for r in done if _unreliable(r)]
    base = registry.BASELINE
    ddp = {(r["world_size"], _rest(r)): r for r in done if r.get("strategy") == base}
    for r in done:
        ref = ddp.get((r["world_size"], _rest(r)))
        if r.get("strategy") in (None, base) or not ref or r["world_size"] < 2:
            continue
        parts = []
        for key, what in (("param_bytes", "parameter bytes"), ("state_bytes", "training state")):
            a, b = _num(r, key), _num(ref, key)
            if a is not None and b:
                parts.append(f"{100 * a / b:.0f}% of {base}'s {what} per rank")
        a, b = _num(r, "samples_per_s"), _num(ref, "samples_per_s")
        trusted = not (_unreliable(r) or _unreliable(ref))
        speed = f"; throughput {100 * (a / b - 1):+.0f}%" if a is not None and b and trusted else ""
        if parts:
            out.append(f"{r['series']} holds {' and '.join(parts)} at {_ranks(r['world_size'])}{speed}.")

    by_series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in done:
        by_series[str(r.get("series"))].append(r)
    for series, runs in sorted(by_series.items()):
        runs = sorted((r for r in runs if _num(r, "samples_per_s")), key=lambda r: r["world_size"])
        shaky = [r for r in runs if _unreliable(r)]
        if len(runs) > 1 and runs[0]["world_size"] != runs[-1]["world_size"] and shaky:
            out.append(f"{series}: scaling not computed: the timings at "
                       f"{', '.join(_ranks(r['world_size']) for r in shaky)} are unreliable.")
        elif len(runs) > 1 and runs[0]["world_size"] != runs[-1]["world_size"]:
            first, last = runs[0], runs[-1]
            gain = last["samples_per_s"] / first["samples_per_s"]
            eff = gain / (last["world_size"] / first["world_size"])
            out.append(f"{series}: {first['world_size']:g} -> {_ranks(last['world_size'])}, "
                       f"throughput x{gain:.2f} (scaling efficiency {100 * eff:.0f}%).")
        accs = [(r["world_size"], r["val_acc"]) for r in sorted(runs, key=lambda r: r["world_size"])
                if _num(r, "val_acc") is not None]
        if len(accs) > 1:
            out.append(f"{series}: validation accuracy " + ", ".join(
                f"{100 * a:.1f}% at {_ranks(n)}" for n, a in accs) + ".")

    by_ranks: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for r in done:
        by_ranks[r["world_size"]].append(r)
    for n, runs in sorted(by_ranks.items()):
        fast = [r for r in runs if _num(r, "samples_per_s")]
        lean = [r for r in runs if _num(r, "state_bytes")]
        shaky = [r for r in fast if _unreliable(r)]
        if len(fast) > 1 and shaky:
            text = f"At {_ranks(n)} no fastest is named (timings of {_names(shaky)} unreliable)"
        elif len(fast) > 1:
            best = max(fast, key=lambda r: r["samples_per_s"])
            text = f"At {_ranks(n)} the fastest is {best['series']} ({best['samples_per_s']:,.0f} samples/s)"
        if len(fast) > 1:
            if len(lean) > 1:
                least = min(r["state_bytes"] for r in lean)
                ties = [r["series"] for r in lean if r["state_bytes"] <= 1.01 * least]
                text += f", the leanest {' and '.join(ties)} ({least / MiB:.2f} MiB of state per rank)"
            out.append(text + ".")
        cpu_fsdp = [r for r in runs if r.get("device") == "cpu" and _shards(r)]
        if n > 1 and cpu_fsdp and ddp.get((n, "")) and _num(ddp[(n, "")], "peak_memory_bytes"):
            r, ref = cpu_fsdp[0], ddp[(n, "")]
            if _num(r, "peak_memory_bytes") and _num(r, "state_bytes") and _num(ref, "state_bytes"):
                out.append(
                    f"On CPU at {_ranks(n)}, peak RSS does not show sharding: {r['series']} peaks at "
                    f"{r['peak_memory_bytes'] / MiB:.0f} MiB vs {base}'s {ref['peak_memory_bytes'] / MiB:.0f} MiB "
                    f"while holding {100 * r['state_bytes'] / ref['state_bytes']:.0f}% of its state.")

    verified = [r for r in done if _num(r, "loss_dev") is not None
                and r.get("series") != registry.REFERENCE]
    if verified:
        loss, params = max(r["loss_dev"] for r in verified), max(r["param_dev"] for r in verified)
        names = ", ".join(dict.fromkeys(str(r["series"]) for r in verified))
        out.append(f"{names} train the same function as {registry.REFERENCE}: per-step losses within {loss:.1e} "
                   f"and final parameters within {params:.1e} (relative, dtlab compare --verify).")

    failed = [r for r in rows if r.get("status") not in (None, "done")]
    if failed:
        out.append(f"{len(failed)} run(s) did not finish: " + "; ".join(
            f"{r.get('series')} at {_ranks(r.get('world_size') or 0)}: {r.get('status')} "
            f"({r.get('reason') or 'no reason recorded'})" for r in failed) + ".")
    return out
