"""How far apart two strategies' predicted step times must be before the prediction orders them
as the runs do: every pair of rows of one predict-vs-measured result (benchmarks/
predict_vs_measured.py --json) at the same config, variant and ranks, grouped by the predicted
margin (slower / faster). dtlab predict calls a margin under core.CLOSE_CALL too close to call.

    python benchmarks/predict_ranking.py docs/results/predict_vs_measured_2026-11-28b.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path

EDGES = (1.0, 1.05, 1.1, 1.2, 1.5, float("inf"))


def pairs(rows: list[dict]) -> list[tuple[float, bool]]:
    """(predicted margin, whether the runs ordered the pair the same way) of every pair."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if "predicted_s" in r and "measured_s" in r:
            groups[(r["config"], r["variant"], r["ranks"])].append(r)
    out = []
    for group in groups.values():
        for a, b in itertools.combinations(group, 2):
            margin = max(a["predicted_s"], b["predicted_s"]) / min(a["predicted_s"],
                                                                    b["predicted_s"])
            same = (a["predicted_s"] < b["predicted_s"]) == (a["measured_s"] < b["measured_s"])
            out.append((margin, same))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a predict_vs_measured.py --json file")
    found = pairs(json.loads(parser.parse_args().results.read_text())["rows"])
    print("| predicted margin | pairs | ordered as measured |\n|---|---|---|")
    for lo, hi in itertools.pairwise(EDGES):
        inside = [same for margin, same in found if lo <= margin < hi]
        if inside:
            span = f"{lo:.2f}x and up" if hi == float("inf") else f"{lo:.2f}x to {hi:.2f}x"
            print(f"| {span} | {len(inside)} | {sum(inside)} "
                  f"({100 * sum(inside) / len(inside):.0f}%) |")


if __name__ == "__main__":
    main()
