"""dtlab comm: every collective checked element by element at 2 and 4 ranks, nccl-tests'
bandwidth definitions, the checker catching a corrupted result, and the alpha-beta model."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from conftest import dtlab, fast_launches

from dtlab.cli.main import main
from dtlab.comm.bench import parse_size, sizes
from dtlab.comm.model import PoorFitError, fit, predict
from dtlab.comm.ops import OPS, busbw_factor, count_for, message_bytes

QUICK = ["--min-bytes", "8", "--max-bytes", "64K", "--factor", "32", "--iters", "3", "--warmup", "1"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_collective_is_exact(ranks: int, tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    with fast_launches():  # the benchmark's ranks from tests/ranks.py
        proc = dtlab("comm", "--op", "all", "--check", "--nproc-per-node", str(ranks), *QUICK,
                     "--p2p", "--p2p-bytes", "64K", "--json", str(out), "--csv",
                     str(tmp_path / "c.csv"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    measured = [r for r in rows if "size_bytes" in r]
    assert {r["op"] for r in measured} == set(OPS) and not [r for r in rows if "unsupported" in r]
    for r in measured:
        assert r["world_size"] == ranks
        variants = [v for v in (r.get("oop"), r.get("ip")) if v]
        assert variants and all(v["wrong"] == 0 and v["time_us"] > 0 for v in variants), r
        assert r["busbw_gbps"] == pytest.approx(
            (r.get("ip") or r["oop"])["algbw_gbps"] * busbw_factor(r["op"], ranks))
    assert proc.stdout.count("# Avg bus bandwidth") == len(OPS)
    assert "#wrong" in proc.stdout and "out-of-place" in proc.stdout
    matrix = next(r for r in rows if r["op"] == "p2p_matrix")
    for i in range(ranks):
        for j in range(ranks):
            assert (matrix["latency_us"][i][j] > 0) == (i != j)
    header = (tmp_path / "c.csv").read_text().splitlines()[0].split(",")
    assert {"op", "size_bytes", "busbw_gbps", "oop_wrong", "ip_time_us"} <= set(header)
    # The machine's load while measuring, and a WARN when it makes the times unreliable.
    timing = next(r for r in rows if r["op"] == "timing")
    assert timing["ranks_on_node"] == ranks and timing["busy_threads"] == ranks * timing["threads_per_rank"]
    assert timing["oversubscribed"] == (timing["busy_threads"] > timing["cores"])
    assert ("# WARN: timings unreliable (" in proc.stdout) == bool(timing["unreliable"])


def test_a_corrupted_result_is_counted(tmp_path: Path) -> None:
    with fast_launches():
        proc = dtlab("comm", "--op", "all_gather", "--check", "--nproc-per-node", "2", *QUICK,
                     "--corrupt-rank", "1")
    assert proc.returncode == 1
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert rows and all(int(cols[8]) >= 1 for cols in rows)  # out-of-place #wrong column


def test_bus_bandwidth_factors_follow_nccl_tests() -> None:
    for n in (2, 4, 8):
        assert busbw_factor("all_reduce", n) == 2 * (n - 1) / n
        for op in ("all_gather", "reduce_scatter", "all_to_all"):
            assert busbw_factor(op, n) == (n - 1) / n
        for op in ("broadcast", "reduce", "send_recv"):
            assert busbw_factor(op, n) == 1.0
    # S is the total size for gather/scatter/all-to-all: count x type size x ranks.
    assert message_bytes("all_gather", 256, 4, 4) == 4096 and message_bytes("all_reduce", 256, 4, 4) == 1024
    assert count_for("reduce_scatter", 4096, 2, 4) == 512 and count_for("all_to_all", 8, 4, 4) == 1


def test_sizes_and_their_parsing() -> None:
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("128M") == 128 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("1.5K") == 1536
    assert sizes(8, 64, 2) == [8, 16, 32, 64] and sizes(1, 3, 1.1) == [1, 2, 3]


@pytest.mark.parametrize("argv", [
    ["--min-bytes", "1M", "--max-bytes", "1K"], ["--factor", "1"], ["--fit", "absent.json"],
])
def test_bad_arguments_exit_2(argv: list[str], capsys) -> None:
    assert main(["comm", *argv]) == 2
    assert capsys.readouterr().err.startswith("dtlab: error: ")


def test_alpha_beta_fit_recovers_a_known_model(tmp_path: Path, capsys) -> None:
    alpha, beta, n = 50e-6, 1 / 2e9, 4  # 50 us per step, 2 GB/s links
    rows = []
    for op in ("all_reduce", "all_gather"):
        k_a, k_b = (2 * (n - 1), 2 * (n - 1) / n) if op == "all_reduce" else (n - 1, (n - 1) / n)
        for s in (1 << 10, 1 << 15, 1 << 20, 1 << 25):
            rows.append({"op": op, "world_size": n, "size_bytes": s,
                         "time_us": (k_a * alpha + k_b * s * beta) * 1e6})
    model = fit(rows)
    for op in ("all_reduce", "all_gather"):
        assert model[op]["r2"] == pytest.approx(1.0)
        assert model[op]["alpha_s"] == pytest.approx(alpha, rel=1e-6)
        assert model[op]["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    t = predict(model, "all_reduce", 64 << 20, 8)
    assert t["ring_s"] == pytest.approx(14 * alpha + 14 / 8 * (64 << 20) * beta)
    assert t["tree_s"] == pytest.approx(6 * (alpha + (64 << 20) * beta))
    path = tmp_path / "m.json"
    path.write_text(json.dumps(rows))
    assert main(["comm", "--fit", str(path), "--predict", "all_reduce:64M:8"]) == 0
    out = capsys.readouterr().out
    assert "1.0000" in out and f"ring {t['ring_s'] * 1e3:.3f} ms" in out
    assert main(["comm", "--fit", str(path), "--predict", "all_reduce:64M"]) == 2
    assert math.isfinite(model["all_gather"]["a_s"])


def ring_rows(op: str, n: int, sizes: list[int], time_of: object) -> list[dict]:
    return [{"op": op, "world_size": n, "size_bytes": s, "time_us": time_of(s)} for s in sizes]


DECADES = [1 << k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
SMALL = [8 << k for k in range(0, 14, 5)]  # 8 B .. 64 KiB: the sweep the issue fitted


def degenerate_sweeps() -> dict[str, list[dict]]:
    return {
        "one size": ring_rows("all_reduce", 2, [1 << 20], lambda s: 900.0),
        "two sizes": ring_rows("all_reduce", 2, [1 << 10, 1 << 20], lambda s: 100 + s / 1000),
        "flat": ring_rows("all_reduce", 2, DECADES, lambda s: 300.0),
        "decreasing": ring_rows("all_gather", 2, DECADES, lambda s: 5000 - 150 * math.log2(s)),
        "one rank": ring_rows("broadcast", 1, DECADES, lambda s: 1 + s / 1e4),
        "latency only": ring_rows("all_reduce", 2, SMALL, lambda s: [310, 280, 335][s % 3]),
        "not measurements": ring_rows("reduce", 2, DECADES, lambda s: [0.0, -5.0, math.nan][s % 3]),
    }


def noisy_sweeps(seed: int) -> list[dict]:
    """a + b S times (50 us, 1.2 GB/s) with log-normal noise of 5 to 40% and, from seed 6 on,
    10x spikes in 15% of the sizes; large sweeps (1K-64M) for odd seeds, small ones else."""
    rng = random.Random(seed)
    sigma, spikes = (0.05, 0.15, 0.4)[seed % 3], 0.15 if seed >= 6 else 0.0
    rows = []
    for op, n in (("all_reduce", 2), ("all_gather", 4), ("send_recv", 2)):
        sizes = DECADES if seed % 2 else SMALL
        rows += ring_rows(op, n, sizes, lambda s: (50 + s / 1200) * rng.lognormvariate(0, sigma)
                          * (10 if rng.random() < spikes else 1))
    return rows


def check_fit_output(rows: list[dict], tmp_path: Path, capsys) -> tuple[str, dict]:
    """`dtlab comm --fit` on these rows: no negative, infinite or NaN number is printed, and
    every refused collective is one line saying what to measure."""
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(rows))
    model = fit(rows)
    assert main(["comm", "--fit", str(path)]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"-\d|inf|nan", out, re.IGNORECASE), out
    refused = [line for line in out.splitlines() if "fit refused" in line]
    assert len(refused) == sum(1 for m in model.values() if m["refused"])
    assert all("fix: measure" in line or "fix: more iterations" in line for line in refused)
    for op, m in model.items():
        assert m["a_s"] >= 0 and m["b_s_per_byte"] >= 0 and math.isfinite(m["a_s"])
        for n in (2, 8, 64):
            if m["refused"]:
                with pytest.raises(PoorFitError, match="fix: "):
                    predict(model, op, 64 << 20, n)
            else:
                t = predict(model, op, 64 << 20, n)
                assert 0 < t["ring_s"] < math.inf and 0 < t["tree_s"] < math.inf
        if not m["refused"]:
            assert m["b_s_per_byte"] > 0 and m["r2"] >= 0.9 and m["max_factor_off"] <= 2
    return out, model


@pytest.mark.parametrize("seed", range(12))
def test_noisy_measurements_never_give_negative_or_infinite_numbers(seed: int, tmp_path: Path,
                                                                    capsys) -> None:
    _, model = check_fit_output(noisy_sweeps(seed), tmp_path, capsys)
    if seed in (1, 3):  # 1K-64M with 5-15% noise: trusted, and near the true a and b
        for m in model.values():
            assert m["refused"] is None
            assert m["a_s"] == pytest.approx(50e-6, rel=0.3)
            assert m["b_s_per_byte"] == pytest.approx(1 / 1.2e9, rel=0.3)


def test_degenerate_sweeps_are_refused_with_what_to_measure(tmp_path: Path, capsys) -> None:
    for name, rows in degenerate_sweeps().items():
        _, model = check_fit_output(rows, tmp_path, capsys)
        (m,) = model.values()
        assert m["refused"], name
    reasons = {name: fit(rows)[rows[0]["op"]]["refused"] for name, rows in degenerate_sweeps().items()}
    assert "only 1 message size(s) measured" in reasons["one size"]
    assert "only 2 message size(s)" in reasons["two sizes"]
    assert "does not grow with the message size" in reasons["flat"]
    assert "fix: measure larger messages (--max-bytes 1G)" in reasons["decreasing"]
    assert "measured on 1 rank" in reasons["one rank"]
    assert "fix: measure larger messages" in reasons["latency only"]
    assert fit(degenerate_sweeps()["not measurements"])["reduce"]["points"] == 0
    assert reasons["not measurements"].startswith("no valid time")


def test_a_prediction_from_a_refused_fit_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "flat.json"
    path.write_text(json.dumps(degenerate_sweeps()["flat"]))
    proc = dtlab("comm", "--fit", str(path), "--predict", "all_reduce:64M:8")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("dtlab: error: --predict 'all_reduce:64M:8': no prediction for "
                               "all_reduce from the all_reduce fit: the time does not grow")
    assert " ms" not in proc.stdout and "fit refused" in proc.stdout
    assert dtlab("comm", "--fit", str(path), "--predict", "all_reduce:64M:-3").returncode == 2


def test_the_constrained_fit_is_the_best_non_negative_line() -> None:
    """Times falling with size: plain least squares gives b < 0; the constrained optimum is the
    flat line through the relative-error-weighted mean (b = 0), which no (a, b >= 0) beats."""
    from dtlab.comm.model import line_fit

    s, t = [1e3, 1e5, 1e7], [3e-4, 2e-4, 1e-4]
    a, b = line_fit(s, t)
    cost = sum(((ti - a - b * si) / ti) ** 2 for si, ti in zip(s, t, strict=True))
    assert b == 0 and a == pytest.approx(sum(1 / ti for ti in t) / sum(1 / ti**2 for ti in t))
    for da in (-1e-5, 1e-5):
        for db in (0.0, 1e-12):
            other = sum(((ti - a - da - db * si) / ti) ** 2 for si, ti in zip(s, t, strict=True))
            assert other > cost
    s, t = [1e3, 1e5, 1e7], [1e-6, 5e-5, 5e-3]  # latency below zero by plain least squares
    a, b = line_fit(s, t)
    assert a >= 0 and b > 0


def test_the_readme_fits_the_file_it_measured() -> None:
    """Every `dtlab comm --fit FILE` of the README reads what an earlier command wrote with --json."""
    from conftest import ROOT

    written: set[str] = set()
    fitted = []
    for line in (ROOT / "README.md").read_text().splitlines():
        words = line.split("#")[0].split()
        if words[:2] != ["dtlab", "comm"]:
            continue
        for flag, value in zip(words, words[1:], strict=False):
            if flag == "--json":
                written.add(value)
            if flag == "--fit":
                fitted.append(value)
                assert value in written, f"README fits {value}, which no earlier command writes"
    assert fitted
