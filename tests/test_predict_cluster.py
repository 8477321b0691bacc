"""Cluster files, and the prices of communication and compute on them (dtlab predict's inputs):
predict/cluster.py, price.py, roofline.py. All in this process: nothing here starts a rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dtlab.comm.model import PoorFitError
from dtlab.errors import ConfigError, DtlabError
from dtlab.predict import roofline
from dtlab.predict.cluster import CLUSTER_DIR, known_clusters, load_cluster
from dtlab.predict.events import Compute, Issue
from dtlab.predict.price import comm_seconds
from dtlab.predict.roofline import compute_seconds

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SHIPPED = ["a100_sxm_8x", "cpu_gloo", "h100_sxm_8x", "h200_sxm_8x"]


def one_line(e: pytest.ExceptionInfo[DtlabError]) -> str:
    """The message the CLI prints: one line, exit code 2."""
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)
    return str(e.value)


def write(tmp_path: Path, text: str, name: str = "mine.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


H100 = (CLUSTER_DIR / "h100_sxm_8x.yaml").read_text()


# ------------------------------------------------------------------------------ the files
def test_shipped_cluster_files_load_with_a_source_for_every_number() -> None:
    """Every shipped cluster file loads, by name and through configs/clusters/, with a source
    for each number."""
    assert known_clusters() == SHIPPED
    for name in SHIPPED:
        c = load_cluster(name)
        by_path = load_cluster(str(ROOT / "configs" / "clusters" / f"{name}.yaml"))
        assert (by_path.name, by_path.peak_tflops, by_path.intra) == \
            (c.name, c.peak_tflops, c.intra)
        assert c.gpus_per_node >= 1 and c.memory_bytes > 0 and 0 < c.compute_efficiency <= 1
        assert c.peak_source and c.memory_source and c.hbm_source
        assert c.compute_efficiency_source and c.overlap_slowdown_source
        assert c.intra.source and c.inter.source
    h100 = load_cluster("h100_sxm_8x")
    assert h100.peak_tflops == {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}
    assert (h100.hbm_bytes_per_s, h100.intra.bus_bytes_per_s, h100.inter.bus_bytes_per_s) == \
        (3.35e12, 400e9, 42e9)
    assert "datasheet" in h100.peak_source and "typical measurement" in h100.inter.source
    assert h100.cores is None and h100.overlap_slowdown == 0.19
    cpu = load_cluster("cpu_gloo")
    assert cpu.peak_tflops == {"fp32": "measure"} and cpu.cores >= 1
    assert cpu.intra.fit is not None and set(cpu.intra.fit) == {
        "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
        "send_recv"}


def test_unknown_cluster_name_lists_the_known_ones() -> None:
    """An unknown cluster name is refused in one line listing the shipped clusters."""
    with pytest.raises(ConfigError) as e:
        load_cluster("h100")
    assert one_line(e) == (
        "unknown cluster 'h100' (did you mean h100_sxm_8x?); fix: use one of a100_sxm_8x, "
        "cpu_gloo, h100_sxm_8x, h200_sxm_8x, or pass a cluster file (.yaml, like "
        "configs/clusters/h100_sxm_8x.yaml)")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("gpus_per_node: 8\n", "gpus_per_node: 8\ngpus_per_node: 4\n"),
     "cluster file '{p}' is not valid YAML at line 11 (key 'gpus_per_node' is written twice, "
     "here and at line 10); fix: write the key once, with everything it should hold"),
    (lambda t: t.replace("  latency_us: 35", "  latency_usec: 35"),
     "cluster file '{p}': unknown key 'inter.latency_usec'; fix: remove it (did you mean "
     "'inter.latency_us'?)"),
    (lambda t: t.replace("hbm_gb_per_s: 3350\n", ""),
     "cluster file '{p}': 'hbm_gb_per_s' is missing; fix: add it (every key of "
     "configs/clusters/h100_sxm_8x.yaml is needed)"),
    (lambda t: t.replace("busbw_gb_per_s: 400", "busbw_gb_per_s: -400"),
     "cluster file '{p}': intra.busbw_gb_per_s: Input should be greater than 0 (got -400); "
     "fix: set intra.busbw_gb_per_s to a valid value (see configs/clusters/h100_sxm_8x.yaml)"),
    (lambda t: t.replace("  busbw_gb_per_s: 42\n", ""),
     "cluster file '{p}': inter has no busbw_gb_per_s; fix: give busbw_gb_per_s and "
     "latency_us, or comm_results: a dtlab comm --json file"),
    (lambda t: t.replace("fp32: 66.9", "fp8: 1979"),
     "cluster file '{p}': peak_tflops: 'fp8' is not a dtype; fix: use bf16, fp16, fp32"),
    (lambda t: "[1, 2]\n",
     "cluster file '{p}' must hold a mapping of keys (key: value lines); fix: write it like "
     "configs/clusters/h100_sxm_8x.yaml"),
    (lambda t: t + "phase_correlation: 0.5\n",
     "cluster file '{p}': the file gives one of phase_correlation and phase_correlation_source; "
     "fix: give both (how in step the ranks sharing a CPU's cores compute, 0 to 1, "
     "benchmarks/sync_cost.py, and where it comes from) or neither"),
    (lambda t: t + "phase_correlation: 0.5\nphase_correlation_source: a fit\n",
     "cluster file '{p}': the file gives phase_correlation without cores; fix: remove it (it "
     "is how ranks share a CPU host's cores) or set cores"),
    (lambda t: t + "phase_correlation: {2: 0.1, 0: 0.3}\nphase_correlation_source: sync_cost\n",
     "cluster file '{p}': phase_correlation {{2.0: 0.1, 0.0: 0.3}} is not a number from 0 to 1 or "
     "a mapping of milliseconds of compute (> 0) to such numbers; fix: give what "
     "benchmarks/sync_cost.py --world 4 measured (0 to 1), one value or one per --matmuls"),
], ids=["duplicate", "unknown", "missing", "negative", "no-bandwidth", "dtype", "not-mapping",
        "phase-unsourced", "phase-without-cores", "phase-table-at-0-ms"])
def test_malformed_cluster_file_is_one_line(tmp_path: Path, edit, message: str) -> None:  # noqa: ANN001
    """A cluster file with a key written twice, an unknown or missing key, a negative bandwidth,
    a link without its bandwidth or an unknown dtype is refused in one line naming the key."""
    path = write(tmp_path, edit(H100))
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert one_line(e) == message.format(p=path)


def test_missing_cluster_file_is_one_line(tmp_path: Path) -> None:
    """A cluster file that does not exist is refused in one line naming the known clusters."""
    with pytest.raises(ConfigError) as e:
        load_cluster(str(tmp_path / "nope.yaml"))
    assert one_line(e) == (
        f"cluster file '{tmp_path / 'nope.yaml'}' not found; fix: pass a cluster name "
        "(a100_sxm_8x, cpu_gloo, h100_sxm_8x, h200_sxm_8x) or an existing file like "
        "configs/clusters/h100_sxm_8x.yaml")


# ------------------------------------------------------------------------ communication
def test_collective_within_a_node_follows_the_nccl_tests_bus_bandwidth() -> None:
    """A collective inside one node costs latency + S x the nccl-tests factor / busbw on the
    intra-node links."""
    c = load_cluster("h100_sxm_8x")
    node = tuple(range(8))
    lat, bw = 15e-6, 400e9
    expected = {"all_reduce": 2 * 7 / 8, "all_gather": 7 / 8, "reduce_scatter": 7 / 8,
                "all_to_all": 7 / 8, "broadcast": 1.0, "reduce": 1.0}
    for op, factor in expected.items():
        t, tier = comm_seconds(Issue(0, op, GIB, node), c, 8)
        assert (tier, t) == ("intra", pytest.approx(lat + GIB * factor / bw, rel=1e-12))
    assert comm_seconds(Issue(0, "send", GIB, (0, 7)), c, 8) == \
        (pytest.approx(lat + GIB / bw), "intra")
    assert comm_seconds(Issue(0, "all_reduce", GIB, (3,)), c, 8) == (0.0, "intra")


def test_collective_across_nodes_takes_the_hierarchical_form() -> None:
    """Across nodes a collective is intra-node steps on the full size plus an inter-node step
    on 1/g of it among the g-th ranks of the nodes; one rank per node runs flat on the
    inter-node links."""
    c = load_cluster("h100_sxm_8x")
    li, bi, le, be = 15e-6, 400e9, 35e-6, 42e9
    s, world = 8 * GIB, tuple(range(16))  # 2 nodes of 8
    rs_intra = li + s * 7 / 8 / bi
    assert comm_seconds(Issue(0, "all_reduce", s, world), c, 8) == (
        pytest.approx(rs_intra + (le + s / 8 * 2 * 1 / 2 / be) + rs_intra), "inter")
    assert comm_seconds(Issue(0, "all_gather", s, world), c, 8)[0] == \
        pytest.approx(le + s / 8 / 2 / be + rs_intra)
    assert comm_seconds(Issue(0, "reduce_scatter", s, world), c, 8)[0] == \
        pytest.approx(rs_intra + le + s / 8 / 2 / be)
    replicas = tuple(range(0, 64, 8))  # rank 0 of each of 8 nodes: HSDP's replica group
    assert comm_seconds(Issue(0, "all_reduce", s, replicas), c, 8) == \
        (pytest.approx(le + s * 2 * 7 / 8 / be), "inter")
    assert comm_seconds(Issue(0, "send", s, (7, 8)), c, 8) == (pytest.approx(le + s / be), "inter")
    # the same group on nodes of 16: one node, the fast links
    assert comm_seconds(Issue(0, "all_reduce", s, world), c, 16)[1] == "intra"


def comm_rows(op: str, alpha_s: float, beta_s: float, noisy: bool = False) -> list[dict]:
    """What dtlab comm --json writes for 2 ranks on an exact alpha-beta line (or pure noise)."""
    sizes = [4096 * 4**i for i in range(6)]
    times = [0.0003 * (1 + (i % 2) * 3) if noisy else 2 * alpha_s + s * beta_s
             for i, s in enumerate(sizes)]
    return [{"op": op, "world_size": 2, "size_bytes": s, "time_us": t * 1e6}
            for s, t in zip(sizes, times, strict=True)]


def fit_cluster(tmp_path: Path, rows: list[dict], fits: str = "") -> str:
    (tmp_path / "comm.json").write_text(json.dumps(rows))
    link = f"  comm_results: comm.json\n{fits}  source: dtlab comm here\n"
    text = H100.split("intra:")[0] + f"intra:\n{link}inter:\n{link}"
    return write(tmp_path, text)


def test_link_from_a_comm_fit_prices_with_the_ring_prediction(tmp_path: Path) -> None:
    """A link given as a dtlab comm result prices each collective with its alpha-beta fit's
    ring prediction."""
    alpha, beta = 50e-6, 1 / 2e9
    c = load_cluster(fit_cluster(tmp_path, comm_rows("all_reduce", alpha, beta)))
    assert c.intra.fit is not None and "alpha-beta fit of comm.json" in c.intra.source
    t, tier = comm_seconds(Issue(0, "all_reduce", 64 << 20, (0, 1, 2, 3)), c, 8)
    assert tier == "intra"
    assert t == pytest.approx(2 * 3 * alpha + 2 * 3 / 4 * (64 << 20) * beta, rel=1e-3)
    t, _ = comm_seconds(Issue(0, "send", 1 << 20, (0, 1)), c, 8)
    assert t == pytest.approx(alpha + (1 << 20) * beta, rel=1e-3)
    # the same measurements as dtlab comm --csv writes them: the same fit
    rows = comm_rows("all_reduce", alpha, beta)
    (tmp_path / "comm.csv").write_text("op,world_size,size_bytes,time_us\n" + "".join(
        f"{r['op']},{r['world_size']},{r['size_bytes']},{r['time_us']}\n" for r in rows))
    from_csv = load_cluster(write(tmp_path, Path(fit_cluster(tmp_path, rows)).read_text()
                                  .replace("comm.json", "comm.csv"), "csv.yaml"))
    assert from_csv.intra.fit == c.intra.fit


def test_poor_comm_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    """A cluster link whose dtlab comm fit is refused (noise, no bandwidth) stops the load in
    one line that says what to measure."""
    rows = comm_rows("all_reduce", 50e-6, 1 / 2e9) + comm_rows("all_gather", 0, 0, noisy=True)
    path = fit_cluster(tmp_path, rows)
    with pytest.raises(PoorFitError) as e:
        load_cluster(path)
    msg = one_line(e)
    assert msg.startswith(f"cluster file '{path}': intra: the all_gather fit of "
                          f"{tmp_path / 'comm.json'} (2 ranks) is refused: ")
    assert "fix: measure larger messages" in msg
    assert msg.endswith("or leave all_gather out of intra.fits (it is then priced from the "
                        "all_reduce fit)")
    # leaving it out, as the message says, prices all_gather from the all_reduce fit
    c = load_cluster(fit_cluster(tmp_path, rows, "  fits: [all_reduce]\n"))
    assert set(c.intra.fit) == {"all_reduce"}
    assert comm_seconds(Issue(0, "all_gather", 1 << 20, (0, 1)), c, 8)[0] > 0


def test_link_with_a_fit_per_number_of_ranks_prices_from_the_nearest_below(
        tmp_path: Path) -> None:
    """A link with one dtlab comm file per number of ranks prices a collective of n ranks from
    the fit measured on the most ranks up to n (the fewest measured, below them); two files of
    the same number of ranks are refused in one line."""
    two = comm_rows("all_reduce", 50e-6, 1 / 2e9)
    four = [{**r, "world_size": 4, "time_us": r["time_us"] * 3} for r in
            comm_rows("all_reduce", 50e-6, 1 / 2e9)]
    (tmp_path / "two.json").write_text(json.dumps(two))
    (tmp_path / "four.json").write_text(json.dumps(four))
    link = "  comm_results: [two.json, four.json]\n  source: dtlab comm here\n"
    c = load_cluster(write(tmp_path, H100.split("intra:")[0] + f"intra:\n{link}inter:\n{link}"))
    assert sorted(c.intra.by_world) == [2, 4] and "on 2, 4 ranks" in c.intra.source

    def price(n: int) -> float:
        return comm_seconds(Issue(0, "all_reduce", 1 << 20, tuple(range(n))), c, 8)[0]

    a2, b2 = c.intra.by_world[2]["all_reduce"]["a_s"], c.intra.by_world[2]["all_reduce"]["b_s_per_byte"]
    assert price(2) == pytest.approx(a2 + b2 * (1 << 20), rel=1e-6)
    a4, b4 = c.intra.by_world[4]["all_reduce"]["a_s"], c.intra.by_world[4]["all_reduce"]["b_s_per_byte"]
    assert price(4) == pytest.approx(a4 + b4 * (1 << 20), rel=1e-6)
    assert price(4) == pytest.approx(3 * price(2), rel=1e-3)
    assert price(8) > price(4)  # the 4-rank fit's alpha and beta on 8 ranks' ring terms
    dup = "  comm_results: [two.json, two.json]\n  source: dtlab comm here\n"
    path = write(tmp_path, H100.split("intra:")[0] + f"intra:\n{dup}inter:\n{dup}", "dup.yaml")
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert one_line(e) == (f"cluster file '{path}': intra.comm_results: {tmp_path / 'two.json'} "
                           "measures 2 ranks, as another of its files does; fix: one dtlab comm "
                           "--json file per number of ranks")


def test_sizes_below_measured_below_are_priced_as_measured(tmp_path: Path) -> None:
    """`measured_below: BYTES`: the line is fitted to the sizes from BYTES up, and a smaller
    collective on the measured ranks costs what was measured (linear between the nearest sizes,
    the line's value at BYTES above the largest), as gloo's one-element all-reduce does; on other
    ranks, and for an op priced from all_reduce's fit, the line still answers. Without it, the
    same points refuse the line (the small sizes' times are far off it)."""
    alpha, beta = 50e-6, 1 / 2e9
    line = comm_rows("all_reduce", alpha, beta)
    small = [{"op": "all_reduce", "world_size": 2, "size_bytes": s, "time_us": us}
             for s, us in ((4, 20.0), (64, 80.0), (64, 100.0), (64, 90.0))]  # 64 B: median 90
    (tmp_path / "comm.json").write_text(json.dumps(small + line))
    link = ("  comm_results:\n  - {file: comm.json, measured_below: 1024}\n"
            "  source: dtlab comm here\n")
    c = load_cluster(write(tmp_path, H100.split("intra:")[0] + f"intra:\n{link}inter:\n{link}"))
    fit = c.intra.by_world[2]["all_reduce"]
    assert fit["a_s"] == pytest.approx(2 * alpha, rel=1e-6)  # the line, as without the points
    assert [s for s, _ in fit["below_line"]] == [4.0, 64.0]
    assert [t for _, t in fit["below_line"]] == pytest.approx([20e-6, 90e-6])

    def price(op: str, size: int, ranks: int = 2) -> float:
        return comm_seconds(Issue(0, op, size, tuple(range(ranks))), c, 8)[0]

    at_1k = 2 * alpha + 1024 * beta
    assert price("all_reduce", 4) == pytest.approx(20e-6)
    assert price("all_reduce", 1) == pytest.approx(20e-6)  # below the smallest: the smallest
    assert price("all_reduce", 34) == pytest.approx(55e-6)  # halfway from 4 to 64 bytes
    assert price("all_reduce", 544) == pytest.approx(90e-6 + (at_1k - 90e-6) / 2)
    assert price("all_reduce", 4096) == pytest.approx(2 * alpha + 4096 * beta, rel=1e-6)
    assert price("all_reduce", 4, ranks=4) == pytest.approx(6 * alpha + 1.5 * 4 * beta, rel=1e-6)
    assert price("broadcast", 4) == pytest.approx(alpha + 4 * beta, rel=1e-6)  # all_reduce's line
    plain = write(tmp_path, H100.split("intra:")[0] + "intra:\n  comm_results: comm.json\n"
                  "  source: dtlab comm here\ninter:\n  comm_results: comm.json\n"
                  "  source: dtlab comm here\n", "plain.yaml")
    with pytest.raises(PoorFitError) as e:
        load_cluster(plain)
    assert f"the all_reduce fit of {tmp_path / 'comm.json'} (2 ranks) is refused: " in one_line(e)


def test_comm_results_that_are_not_a_comm_file_are_one_line(tmp_path: Path) -> None:
    """A link's comm_results that is missing or not a dtlab comm file is refused in one line."""
    path = fit_cluster(tmp_path, [])
    (tmp_path / "comm.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert one_line(e) == (
        f"cluster file '{path}': intra.comm_results '{tmp_path / 'comm.json'}' is not a dtlab "
        f"comm --json/--csv file; fix: measure it with dtlab comm --op all --json "
        f"{tmp_path / 'comm.json'}")
    (tmp_path / "comm.json").unlink()
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert "not found; fix: measure it with dtlab comm --op all --json" in one_line(e)


def test_shipped_cpu_fit_prices_every_op() -> None:
    """The shipped CPU cluster's loopback fit prices every op a trace can issue."""
    c = load_cluster("cpu_gloo")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
               "all_to_all", "send", "recv", "barrier"):
        for group in ((0, 1), tuple(range(8))):
            t, _ = comm_seconds(Issue(0, op, 1 << 20, group), c, 4)
            assert math.isfinite(t) and t > 0


# ------------------------------------------------------------------------------ compute
def test_measured_compute_is_used_as_measured() -> None:
    """Measured compute is used as measured, on a CPU host and on a GPU node alike (the sharing
    of a host's cores is the simulator's, test_predict_simulate.py)."""
    c = load_cluster("cpu_gloo")
    assert compute_seconds(Compute("forward", seconds=0.1), c, "fp32", 1) == (0.1, "measured")
    gpu = load_cluster("h100_sxm_8x")
    assert compute_seconds(Compute("backward", seconds=0.1), gpu, "bf16", 4) == (0.1, "measured")


def test_roofline_compute_from_the_datasheet_peak() -> None:
    """Compute without a measurement is a roofline: FLOPs at the stated efficiency of the
    datasheet peak, or bytes at the HBM bandwidth when that is slower."""
    c = load_cluster("h100_sxm_8x")
    t, source = compute_seconds(Compute("forward", flops=1e15), c, "bf16", 1)
    assert t == pytest.approx(1e15 / (989.4e12 * 0.5))
    assert source == ("roofline at 50% of 989.4 TFLOP/s bf16 (NVIDIA H100 Tensor Core GPU "
                      "datasheet (H100 SXM), dense (without sparsity)), FLOPs only (bytes not "
                      "counted)")
    t, source = compute_seconds(Compute("forward", flops=1e9, bytes=3.35e12), c, "bfloat16", 1)
    assert t == pytest.approx(1.0) and source.endswith("and 3350 GB/s memory")
    t, _ = compute_seconds(Compute("optimizer", flops=1e12), c, "fp32", 1)
    assert t == pytest.approx(1e12 / (66.9e12 * 0.5))


def test_cpu_roofline_measures_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU cluster's peak is a float32 matmul measured at prediction time with the rank's
    threads, not a constant."""
    calls: list[int] = []
    monkeypatch.setattr(roofline, "cpu_matmul_tflops", lambda threads: calls.append(threads) or 0.1)
    roofline._cpu_peak.cache_clear()
    try:
        c = load_cluster("cpu_gloo")
        c.cores = 4
        t, source = compute_seconds(Compute("forward", flops=1e9), c, "fp32", 3)
    finally:
        roofline._cpu_peak.cache_clear()
    assert calls == [3]
    assert t == pytest.approx(1e9 / (0.1e12 * 0.5))
    assert source == ("roofline at 50% of 0.1 TFLOP/s fp32 (float32 matmul measured on this "
                      "CPU now with 3 thread(s)), FLOPs only (bytes bandwidth unknown)")


def test_unknown_peak_for_a_dtype_is_refused_in_one_line(tmp_path: Path) -> None:
    """A roofline in a dtype the cluster file has no peak for is refused in one line."""
    with pytest.raises(ConfigError) as e:
        compute_seconds(Compute("forward", flops=1e9), load_cluster("cpu_gloo"), "bf16", 1)
    assert one_line(e) == (
        "cluster 'cpu_gloo' has no peak for bf16 (it lists fp32); fix: predict with "
        "train.precision=fp32, or add peak_tflops.bf16 with its source to a copy of "
        "configs/clusters/cpu_gloo.yaml (pass the copy to --cluster)")
    path = write(tmp_path, H100.replace("bf16: 989.4, fp16: 989.4, ", ""))
    with pytest.raises(ConfigError) as e:
        compute_seconds(Compute("forward", flops=1e9), load_cluster(path), "bf16", 1)
    assert one_line(e).endswith(f"add peak_tflops.bf16 with its source to {path}")


# ------------------------------------------------------------------------------ sync cost
def test_sync_cost_is_added_to_collectives_that_follow_compute() -> None:
    """The cpu cluster's sync cost (per number of ranks) is added to a collective that follows
    the rank's own compute, once for a run of calls issued back to back, never to messages."""
    from dataclasses import replace

    from dtlab.predict.events import Wait, mark_arrivals

    c = load_cluster("cpu_gloo")
    assert c.intra.sync_s and c.intra.sync_for(2) > 0 and c.intra.sync_for(8) == c.intra.sync_for(4)
    gather = Issue(1, "all_gather", 1 << 20, (0, 1))
    alone, _ = comm_seconds(gather, c, 2)
    after, _ = comm_seconds(replace(gather, after_compute=True), c, 2)
    assert after == pytest.approx(alone + c.intra.sync_for(2))
    send = Issue(2, "send", 1 << 20, (0, 1), after_compute=True)
    assert comm_seconds(send, c, 2)[0] == comm_seconds(replace(send, after_compute=False), c, 2)[0]
    events = [Compute("optimizer", seconds=1e-3), Issue(1, "broadcast", 64, (0, 1)),
              Compute("optimizer", seconds=1e-5), Issue(2, "broadcast", 64, (0, 1)), Wait(1),
              Compute("forward", flops=1e6), Issue(3, "all_reduce", 64, (0, 1)), Wait(3),
              Issue(4, "all_reduce", 64, (0, 1))]
    marked = [e.after_compute for e in mark_arrivals(events) if isinstance(e, Issue)]
    assert marked == [True, False, True, False]
    gpu = load_cluster("h100_sxm_8x")  # not measured there: nothing added
    big = Issue(1, "all_reduce", 1 << 20, tuple(range(8)))
    assert comm_seconds(replace(big, after_compute=True), gpu, 8) == comm_seconds(big, gpu, 8)


def test_calls_issued_back_to_back_are_priced_with_the_burst_factor(tmp_path: Path) -> None:
    """A run of two or more collectives issued back to back (no compute, no wait between) is a
    burst: each call's price is multiplied by the link's factor for its op and number of ranks
    (the measurement on the most ranks up to n); a lone call, a message, an op without a factor
    keep their price. A factor without its source is one line."""
    from dataclasses import replace

    from dtlab.predict.events import Wait, mark_arrivals

    events = [Compute("optimizer", seconds=1e-3), Issue(1, "broadcast", 64, (0, 1)),
              Compute("optimizer", seconds=1e-5), Issue(2, "broadcast", 64, (0, 1)),
              Issue(3, "broadcast", 64, (0, 1)), Wait(1), Issue(4, "all_reduce", 64, (0, 1)),
              Compute("forward", seconds=1e-3), Issue(5, "all_reduce", 64, (0, 1)),
              Issue(6, "send", 64, (0, 1)), Issue(7, "all_reduce", 64, (0, 1))]
    marked = [(e.id, e.in_burst) for e in mark_arrivals(events) if isinstance(e, Issue)]
    assert marked == [(1, True), (2, True), (3, True), (4, False), (5, False), (6, False),
                      (7, False)]
    burst = "burst: {broadcast: {2: 1.5, 4: 0.25}}\n  burst_source: measured"
    path = write(tmp_path, H100.replace("  latency_us: 15\n", f"  latency_us: 15\n  {burst}\n", 1))
    c = load_cluster(path)
    assert c.intra.burst_for("broadcast", 3) == 1.5 and c.intra.burst_for("broadcast", 8) == 0.25
    assert c.intra.burst_for("all_gather", 8) == 1.0 and c.inter.burst_for("broadcast", 8) == 1.0
    call = Issue(1, "broadcast", 1 << 20, tuple(range(8)))
    alone, _ = comm_seconds(call, c, 8)
    assert comm_seconds(replace(call, in_burst=True), c, 8)[0] == pytest.approx(alone * 0.25)
    gather = Issue(1, "all_gather", 1 << 20, tuple(range(8)))
    assert comm_seconds(replace(gather, in_burst=True), c, 8) == comm_seconds(gather, c, 8)
    path = write(tmp_path, H100.replace("  latency_us: 15\n",
                                        "  latency_us: 15\n  burst: {broadcast: {2: 1.5}}\n", 1))
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    assert one_line(e) == (
        f"cluster file '{path}': intra gives one of burst and burst_source; fix: give both (what "
        "a call issued back to back with others costs over its price, benchmarks/burst_cost.py, "
        "and where it comes from) or neither")


def test_step_overhead_lengthens_a_step_of_several_ranks(tmp_path: Path) -> None:
    """A cluster's step_overhead (per number of ranks, the measurement on the most ranks up to
    the world's) lengthens the simulated step of several ranks by that fraction, says so in the
    row, and leaves one rank's alone; without its source, or above 1, it is one line."""
    from dtlab.predict.core import Request, predict

    measured = "step_overhead: {2: 0.1, 4: 0.25}\nstep_overhead_source: 'measured here: calib'\n"
    c = load_cluster(write(tmp_path, H100 + measured))
    assert [c.overhead_for(n) for n in (1, 2, 3, 4, 64)] == [0.0, 0.1, 0.1, 0.25, 0.25]
    assert load_cluster(write(tmp_path, H100 + measured.replace("{2: 0.1, 4: 0.25}", "0.2"))
                        ).step_overhead == {2: 0.2}
    plain = load_cluster("h100_sxm_8x")
    assert plain.overhead_for(8) == 0.0
    for world, fraction in ((2, 0.1), (1, 0.0)):
        base = predict(Request(None, [], world, world, plain), "ddp")
        row = predict(Request(None, [], world, world, c), "ddp")
        assert row["step_s"] == pytest.approx(base["step_s"] * (1 + fraction), rel=1e-12)
        assert row["overhead_s"] == pytest.approx(base["step_s"] * fraction, rel=1e-12)
        assert row["sources"].get("overhead") == (["measured here"] if fraction else None)
        assert base["overhead_s"] == 0 and "overhead" not in base["sources"]
    for text, message in (
            ("step_overhead: 0.1\n", "the file gives one of step_overhead and "
             "step_overhead_source; fix: give both (what a real step of that many ranks takes "
             "beyond the simulated one, benchmarks/calibrate_cpu.py, and where it comes from) "
             "or neither"),
            ("step_overhead: 1.5\nstep_overhead_source: a guess\n",
             "step_overhead: Input should be less than or equal to 1 or a valid dictionary "
             "(got 1.5); fix: set step_overhead to a valid value (see "
             "configs/clusters/h100_sxm_8x.yaml)")):
        path = write(tmp_path, H100 + text)
        with pytest.raises(ConfigError) as e:
            load_cluster(path)
        assert one_line(e) == f"cluster file '{path}': {message}"
