"""The figures of a one-run report (`dtlab report RUN_DIR`), returned as PNG bytes to embed: a
report of one run writes nothing into the run directory but the report itself."""

from __future__ import annotations

import io
from typing import Any

from dtlab.results.plot import MiB, _pyplot

# The columns of summary["profile"]'s table (seconds), as the report names them.
PROFILE_COLUMNS = [("step_s", "whole step"), ("data_s", "data"), ("compute_s", "compute"),
                   ("optimizer_s", "optimizer"), ("comm_s", "comm"),
                   ("exposed_comm_s", "exposed comm"), ("overlapped_comm_s", "overlapped comm"),
                   ("other_s", "other")]
# The parts that add up to a step, in the order they happen: overlapped communication runs under
# compute (it adds no time) and is drawn as its own bar; comm_s is exposed + overlapped.
STEP_PARTS = [c for c in PROFILE_COLUMNS if c[0] in ("data_s", "compute_s", "optimizer_s",
                                                     "exposed_comm_s", "other_s")]


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def xy(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if number(r.get("step")) and number(r.get(key))]


def _png(plt: Any, fig: Any) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def curves(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> bytes | None:
    """Loss (train and val), learning rate and throughput against the step; one panel each,
    only the panels with data; None when nothing was logged."""
    rate = "tokens_per_s" if xy(train, "tokens_per_s") else "samples_per_s"
    panels = [(("train loss", xy(train, "loss")), ("val loss", xy(val, "val_loss"))),
              (("learning rate", xy(train, "lr")),),
              ((rate.replace("_per_s", "/s"), xy(train, rate)),)]
    titles = ["Loss", "Learning rate", "Throughput"]
    ylabels = ["loss (cross-entropy, nats)", "learning rate", rate.replace("_per_s", "/s")]
    keep = [i for i, p in enumerate(panels) if any(pts for _, pts in p)]
    if not keep:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keep), figsize=(4.6 * len(keep), 3.6), squeeze=False)
    for ax, i in zip(axes[0], keep, strict=True):
        for label, pts in panels[i]:
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        label=label)
        ax.set(title=titles[i], xlabel="step", ylabel=ylabels[i])
        ax.xaxis.get_major_locator().set_params(integer=True)  # no step 1.5
        if i == 2:  # zero matters for a rate: a 2% wobble is not drawn as a collapse
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
        if len([1 for _, pts in panels[i] if pts]) > 1:
            ax.legend(fontsize="small")
    return _png(plt, fig)


def memory(per_rank: dict[str, list[float]]) -> bytes | None:
    """Grouped bars: one group per rank, one bar per kind of memory (MiB)."""
    kinds = [k for k, v in per_rank.items() if v and all(number(x) for x in v)]
    if not kinds:
        return None
    plt = _pyplot()
    ranks = max(len(per_rank[k]) for k in kinds)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(kinds)
    for j, k in enumerate(kinds):
        values = per_rank[k]
        ax.bar([r + (j - (len(kinds) - 1) / 2) * width for r in range(len(values))],
               [v / MiB for v in values], width, label=k.removesuffix("_bytes"))
    ax.set_xticks(range(ranks), [str(r) for r in range(ranks)])
    values = [v for k in kinds for v in per_rank[k] if v > 0]
    log = bool(values) and max(values) > 50 * min(values)  # RSS next to parameter bytes
    if log:
        ax.set_yscale("log")
    ax.set(title="Memory per rank", xlabel="rank", ylabel="MiB (log scale)" if log else "MiB")
    ax.legend(fontsize="small")
    return _png(plt, fig)


def step_breakdown(median: dict[str, Any]) -> bytes | None:
    """The median step as one stacked bar (ms), overlapped communication beside it."""
    parts = [(label, median[k] * 1000) for k, label in STEP_PARTS if number(median.get(k))]
    if not parts:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 2.6))
    left, compute_at = 0.0, 0.0
    for label, ms in parts:
        compute_at = left if label == "compute" else compute_at
        ax.barh(["median step"], [ms], left=left, label=label)
        left += ms
    if number(median.get("overlapped_comm_s")):  # drawn below the compute it hides under
        ax.barh(["overlapped comm\n(under compute)"], [median["overlapped_comm_s"] * 1000],
                left=compute_at, color="gray", label="overlapped comm")
    ax.set(title="Median step, by part", xlabel="ms")
    ax.invert_yaxis()
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(plt, fig)
