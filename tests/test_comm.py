"""dtlab comm: every collective checked element by element at 2 and 4 ranks, nccl-tests'
bandwidth definitions, the checker catching a corrupted result, and the alpha-beta model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import dtlab, fast_launches

from dtlab.cli import main
from dtlab.comm.bench import parse_size, sizes
from dtlab.comm.model import fit, predict
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
