"""`dtlab estimate` and `dtlab advise`: the arithmetic, the measured (fake backend) and DeepSpeed
layouts against real trainings, the activation model against autograd, communication volumes,
advice and bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, cli, dtlab, free_port, needs

from dtlab.comm.model import fit, predict
from dtlab.config import load_config
from dtlab.config.strategies import registry
from dtlab.data import spec_for
from dtlab.errors import DtlabError
from dtlab.estimate import activations, comm, memory
from dtlab.estimate.advise import advise
from dtlab.estimate.core import Setup, estimate, exact_state, model_from_config, model_from_size
from dtlab.estimate.measure import batch, fake_group, measure, meta_model
from dtlab.models import build_model, count_params
from dtlab.strategies import deepspeed_memory

GB = 1e9
FP32, BF16 = memory.PRECISIONS["fp32"], memory.PRECISIONS["bf16"]


def state(n: float, token: str, world: int, precision=FP32, opt: str = "adamw") -> memory.State:
    return memory.state_per_rank(n, memory.parse_plan(token, world), precision, opt, world)


# ---------------------------------------------------------------------- per-rank arithmetic
def test_textbook_7b_adamw_fp32_on_4_gpus() -> None:
    ddp = state(7e9, "ddp", 4)
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.master) == (28 * GB, 28 * GB, 56 * GB, 0)
    assert ddp.total == 112 * GB
    assert state(7e9, "zero3", 4).total == 28 * GB
    assert state(7e9, "FULL_SHARD", 4) == state(7e9, "fsdp", 4) == state(7e9, "zero3", 4)


def test_textbook_through_the_command_line() -> None:
    proc = dtlab("estimate", "--n-params", "7e9", "--world-size", "4", "--optimizer", "adamw",
                 "--precision", "fp32", "--strategies", "ddp,zero3", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["strategy"]: r for r in json.loads(proc.stdout)["rows"]}
    assert [rows["ddp"][k] for k in ("params", "grads", "optimizer", "state")] == \
        [28e9, 28e9, 56e9, 112e9]
    assert rows["zero3"]["state"] == 28e9
    table = dtlab("estimate", "--n-params", "7B", "--world-size", "4", "--strategies", "ddp,zero3")
    lines = table.stdout.splitlines()
    assert "28.00  28.00    0.00  56.00  112.00" in next(x for x in lines if x.startswith("ddp"))
    assert " 28.00 " in next(x for x in lines if x.startswith("zero3"))


def test_bf16_mixed_precision_is_16_bytes_per_parameter() -> None:
    s = state(1e9, "ddp", 1, BF16)
    assert (s.params, s.grads, s.master, s.optimizer) == (2e9, 2e9, 4e9, 8e9)
    assert s.total == 16e9  # 2 + 2 + K, K = 12 (the ZeRO paper)
    autocast = state(1e9, "ddp", 1, memory.PRECISIONS["bf16-autocast"])
    assert autocast.total == 16e9 and autocast.master == 0 and autocast.params == 4e9


@pytest.mark.parametrize("token, params, grads, opt", [
    ("ddp", 2, 2, 12), ("zero1", 2, 2, 12 / 8), ("zero2", 2, 2 / 8, 12 / 8),
    ("zero3", 2 / 8, 2 / 8, 12 / 8), ("hybrid:4", 2 / 4, 2 / 4, 12 / 4),
])
def test_zero_stages_divide_what_they_shard(token: str, params: float, grads: float,
                                            opt: float) -> None:
    s = state(1e9, token, 8, BF16)
    assert s.params == pytest.approx(params * 1e9) and s.grads == pytest.approx(grads * 1e9)
    assert s.master + s.optimizer == pytest.approx(opt * 1e9)
    offloaded = state(1e9, "zero2+offload", 8, BF16)
    assert offloaded.offloaded == pytest.approx((2 / 8 + 12 / 8) * 1e9)
    assert offloaded.device == pytest.approx(2e9)  # ZeRO-Offload: 16-bit weights stay


def test_optimizer_state_bytes() -> None:
    assert state(1e6, "ddp", 1, opt="sgd").optimizer == 0
    assert state(1e6, "ddp", 1, opt="sgd-momentum").optimizer == 4e6
    assert state(1e6, "ddp", 1, opt="adamw").optimizer == 8e6


# ----------------------------------------------- measured (fake backend) layouts vs real runs
# (label, overrides). Each runs a few real steps of dtlab's training loop on 2 gloo ranks and
# its measured memory_per_rank must equal exact_state (the fake-backend measurement, or
# DeepSpeed's model) on every rank, to the byte. When a strategy joins dtlab.strategies.MODULES,
# add its line here.
# Odd sizes, so that every padding rule matters: FSDP2 pads 33 and 5 rows to 34 and 6, FSDP1
# aligns each tensor to 16 bytes (4 fp32 or 8 bf16 elements), and the ranks hold unequal shards.
CNN = ["model.name=cnn", "model.hidden=33", "data.synthetic.num_classes=5"]  # SGD, momentum
GPT = ["model.name=gpt", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
       "model.vocab_size=101", "model.block_size=31", "train.optimizer=adamw", "train.lr=1e-3"]
RUNS = [
    ("cnn-ddp", [*CNN, "strategy.name=ddp"]),
    ("cnn-fsdp", [*CNN, "strategy.name=fsdp"]),
    ("cnn-fsdp1", [*CNN, "strategy.name=fsdp1"]),
    ("cnn-fsdp1-grad-op", [*CNN, "strategy.name=fsdp1",
                           "strategy.fsdp1.sharding_strategy=SHARD_GRAD_OP"]),
    ("cnn-fsdp1-no-shard", [*CNN, "strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=NO_SHARD"]),
    ("cnn-fsdp1-bf16", [*CNN, "strategy.name=fsdp1", "train.precision=bf16"]),
    ("cnn-fsdp1-size-wrap", [*CNN, "strategy.name=fsdp1", "strategy.fsdp1.auto_wrap=size",
                             "strategy.fsdp1.min_num_params=1000"]),
    ("cnn-zero1", [*CNN, "strategy.name=zero1"]),
    ("gpt-ddp", [*GPT, "strategy.name=ddp"]),
    ("gpt-zero1", [*GPT, "strategy.name=zero1"]),
    ("gpt-fsdp", [*GPT, "strategy.name=fsdp"]),
    ("gpt-fsdp-bf16", [*GPT, "strategy.name=fsdp", "train.precision=bf16",
                       "strategy.fsdp.reduce_fp32=false"]),
    ("gpt-fsdp1", [*GPT, "strategy.name=fsdp1"]),
    ("gpt-fsdp1-hybrid", [*GPT, "strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=HYBRID_SHARD",
                          "strategy.fsdp1.shard_group_size=1"]),
    # tensor parallelism splits heads, vocabulary and sequence: even sizes, odd halves (51, 15)
    ("gpt-tp", [*GPT, "model.vocab_size=102", "model.block_size=30", "strategy.name=tp"]),
    ("gpt-fsdp_tp", [*GPT, "strategy.name=fsdp_tp", "strategy.tp.degree=1"]),  # 2 x 1 mesh
    ("gpt-pp", [*GPT, "strategy.name=pp"]),
    ("gpt-pp-dp", [*GPT, "strategy.name=pp", "strategy.pp.degree=1", "strategy.pp.dp=ddp"]),
]
# DeepSpeed ZeRO (strategies/deepspeed_memory.py), trained last in the same process group: every stage on
# both models, bf16, optimizer and parameter offload, and gradient accumulation (ZeRO 1 holds
# every gradient whole between micro batches, ZeRO 2 with offload per-tensor host accumulators).
HAS_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = needs("deepspeed", "deepspeed")
DS = ["strategy.name=deepspeed"]
DS_RUNS = [
    ("cnn-ds1", [*CNN, *DS, "strategy.deepspeed.zero_stage=1"]),
    ("cnn-ds2", [*CNN, *DS, "strategy.deepspeed.zero_stage=2"]),
    ("cnn-ds3", [*CNN, *DS, "strategy.deepspeed.zero_stage=3"]),
    ("gpt-ds1-accum", [*GPT, *DS, "strategy.deepspeed.zero_stage=1", "train.grad_accum_steps=2"]),
    ("gpt-ds2", [*GPT, *DS, "strategy.deepspeed.zero_stage=2"]),
    ("gpt-ds3", [*GPT, *DS, "strategy.deepspeed.zero_stage=3"]),
    ("gpt-ds3-bf16", [*GPT, *DS, "strategy.deepspeed.zero_stage=3", "train.precision=bf16"]),
    ("gpt-ds2-offload-accum", [*GPT, *DS, "strategy.deepspeed.zero_stage=2",
                               "strategy.deepspeed.offload_optimizer=true",
                               "train.grad_accum_steps=2"]),
    ("gpt-ds3-offload", [*GPT, *DS, "strategy.deepspeed.zero_stage=3",
                         "strategy.deepspeed.offload_optimizer=true",
                         "strategy.deepspeed.offload_param=true"]),
]
SHORT = ["train.max_steps=3", "train.global_batch_size=8", "data.synthetic.train_samples=64",
         "data.synthetic.val_samples=16", "run.progress=false", "run.log_every=100"]


def train_all(rank: int, port: int, root: str) -> None:
    """One process group, every run through dtlab's training loop in turn (no relaunch each)."""
    from dtlab.distributed import DistEnv, distributed
    from dtlab.train import train

    env = DistEnv(rank, rank, 2, 2, "127.0.0.1", port, "torchrun")
    measured = {}
    with distributed(timeout_s=120, env=env) as ctx:
        for label, overrides in RUNS + (DS_RUNS if HAS_DS else []):
            cfg = load_config(None, [*overrides, *SHORT, f"run.dir={root}/{label}"])
            measured[label] = train(cfg, ctx)["memory_per_rank"]
            dist.barrier()
    if rank == 0:
        Path(root, "measured.json").write_text(json.dumps(measured))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("estimate")
    mp.start_processes(train_all, args=(free_port(), str(root)), nprocs=2, join=True,
                       start_method="forkserver")  # tests/ranks.py's, torch preloaded
    return json.loads((root / "measured.json").read_text())


ALL_RUNS = [pytest.param(*run, id=run[0]) for run in RUNS] + [
    pytest.param(*run, marks=needs_ds, id=run[0]) for run in DS_RUNS]


@pytest.mark.parametrize("label, overrides", ALL_RUNS)
def test_exact_state_equals_measured(measured: dict, label: str, overrides: list[str]) -> None:
    mem = measured[label]
    est, _ = exact_state(load_config(None, overrides), 2, ranks_per_node=2)
    for rank in range(2):
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            got, want = mem[key][rank], est[rank][key]
            assert got == want, f"{label} rank {rank} {key}: {want} vs {got}"


@needs_ds
@pytest.mark.parametrize("label, overrides", DS_RUNS, ids=[r[0] for r in DS_RUNS])
def test_deepspeed_layout_is_exact_to_the_byte(measured: dict, label: str,
                                               overrides: list[str]) -> None:
    """The same, byte for byte, and DeepSpeed's buckets and staging buffers too (its scalars,
    norms and flags, are not modelled: at most a few hundred bytes)."""
    mem = measured[label]
    est, _ = exact_state(load_config(None, overrides), 2, 2)
    for rank in range(2):
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert mem[key][rank] == est[rank][key], f"{label} rank {rank} {key}"
        assert 0 <= mem["buffer_bytes"][rank] - est[rank]["buffer_bytes"] <= 512


@needs_ds
def test_deepspeed_is_not_the_textbook_zero(measured: dict) -> None:
    """What the exact layout captures that P/n arithmetic misses (P: fp32 parameter bytes)."""
    p = 4 * count_params(meta_model(load_config(None, GPT)))
    ds2, ds3 = measured["gpt-ds2"], measured["gpt-ds3"]
    assert ds2["optim_bytes"] == [3 * p // 2 + 4] * 2  # fp32 master + AdamW moments, / 2
    assert ds2["grad_bytes"][0] != ds2["grad_bytes"][1] and min(ds2["grad_bytes"]) > p // 2
    assert ds3["param_bytes"] == [3 * p // 2] * 2  # every GPT tensor is below 100,000 elements
    assert measured["gpt-ds3-bf16"]["param_bytes"] == [3 * p // 4] * 2
    assert ds3["buffer_bytes"][0] >= 500_000_000 * 4  # the reduce bucket, allocated up front
    assert measured["gpt-ds1-accum"]["grad_bytes"] == [p, p]  # whole between micro batches


@needs_ds
def test_estimate_command_prints_the_exact_deepspeed_rows(
        measured: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.cli.main import main

    stages = ["deepspeed:1", "deepspeed:2", "deepspeed:3"]
    assert main(["estimate", *GPT, "--world-size", "2", "--strategies", ",".join(stages),
                 "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for spec, label in zip(stages, ["gpt-ds1-accum", "gpt-ds2", "gpt-ds3"], strict=True):
        row = rows[spec]
        assert row["exact"] and row["layout"] == f"zero{spec[-1]}"
        mem = measured[label]
        for rank, held in enumerate(row["per_rank"]):
            for key in ("param_bytes", "optim_bytes") + (("grad_bytes",) if spec != stages[0] else ()):
                assert held[key] == mem[key][rank], f"{spec} rank {rank} {key}"
        assert 3 * row["master"] + 4 == mem["optim_bytes"][0]  # fp32 master, shown apart
    assert rows["deepspeed:3"]["temporaries"]["buffers"] == 4 * 500_000_000
    assert main(["estimate", *GPT, "--world-size", "2", "--strategies", "deepspeed:2"]) == 0
    assert "deepspeed:2 per rank (param, grad, optim bytes): 459520, 233216, 689284; " \
        "459520, 291840, 689284" in capsys.readouterr().out


def test_deepspeed_rules_on_paper() -> None:
    """Without DeepSpeed: the partition rules on sizes chosen so that every branch matters."""
    # stage 1/2: 3 tensors (10, 7, 4) = 21 elements, padded to 24 (2 x 4 ranks): slices of 6
    numels = [10, 7, 4]
    grads = [deepspeed_memory.slice_grad_elements(numels, 6, r) for r in range(4)]
    # rank 0: only the 10 (elements 0-5); rank 1: 10 (6-9) and 7 (10-11); rank 2: 7 (12-16),
    # 4 (17); rank 3: 4 (18-20) and 3 elements of padding
    assert grads == [(10, 0), (17, 0), (11, 0), (4, 3)]
    assert deepspeed_memory.slice_grad_elements([4], 4, 1) == (0, 4)  # all padding
    o = deepspeed_memory.ZeroOptions(stage=3, persistence_threshold=5, sub_group_size=4)
    assert deepspeed_memory.persistent(numels, o) == [False, False, True]
    stage3 = deepspeed_memory.stage3(numels, o, 4, 4, "adamw", 0.0)[0]
    parts = 3 + 2 + 1  # ceil(n / 4) each
    assert stage3["param_bytes"] == 4 * (parts + 4)  # + the persistent 4, gathered
    assert stage3["optim_bytes"] == 4 * parts + 8 * parts + 4 * 2  # 2 sub groups of >= 4


def test_deepspeed_knob_without_a_layout_is_refused(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.cli.main import main

    ds_json = tmp_path / "rr.json"
    ds_json.write_text('{"zero_optimization": {"stage": 2, "round_robin_gradients": true}}')
    assert main(["estimate", "--world-size", "2", "--strategies", "deepspeed",
                 "strategy.name=deepspeed", f"strategy.deepspeed.config={ds_json}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "round_robin_gradients=true: no exact layout" in err


def test_sharding_changes_the_measured_bytes(measured: dict) -> None:
    """The check is not vacuous: the layouts differ from each other, and per rank."""
    assert measured["cnn-fsdp"]["param_bytes"][0] < measured["cnn-ddp"]["param_bytes"][0]
    for model in ("cnn", "gpt"):
        assert measured[f"{model}-fsdp"]["param_bytes"] != measured[f"{model}-fsdp1"]["param_bytes"]
        assert len(set(measured[f"{model}-fsdp"]["optim_bytes"])) == 2  # unequal shards
    assert measured["cnn-fsdp1-bf16"]["param_bytes"] != measured["cnn-fsdp1"]["param_bytes"]


def test_large_worlds_measure_the_ranks_that_hold_the_most() -> None:
    """Beyond 16 ranks the estimate measures rank 0 and the ranks whose share no other rank
    matches or exceeds (measured.ranks_to_measure): every kind's maximum over all ranks is among
    them. FSDP1's largest optimizer state is on a rank in the middle here, zero1's on rank 0."""
    for strategy, ranks in (("fsdp1", [0, 13]), ("zero1", [0])):
        cfg = load_config(None, [*GPT, f"strategy.name={strategy}"])
        chosen, every = measure(cfg, 40, 8), measure(cfg, 40, 8, every_rank=True)
        assert [r["rank"] for r in chosen] == ranks and len(every) == 40
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert max(r[key] for r in chosen) == max(r[key] for r in every), (strategy, key)
            assert all(r == every[r["rank"]] for r in chosen)


def test_the_fake_group_never_touches_a_real_one() -> None:
    with fake_group(3, 8):
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (3, 8, "fake")
        with pytest.raises(DtlabError, match="already initialised"), fake_group(0, 2):
            pass
        assert dist.get_world_size() == 8  # still the outer group
    assert not dist.is_initialized()


def test_1024_ranks_are_measured_in_one_process(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlab.cli.main import main

    monkeypatch.chdir(ROOT)
    assert main(["estimate", "--config", "configs/fsdp_gpt.yaml", "--world-size", "1024",
                 "--strategies", "fsdp,zero2", "--json"]) == 0
    fsdp, zero2 = json.loads(capsys.readouterr().out)["rows"]
    assert (fsdp["source"], fsdp["exact"], zero2["source"]) == (
        "measured (fake backend)", True, "modelled (ideal layout)")
    assert fsdp["per_rank"] == [{"param_bytes": 20120, "grad_bytes": 20120, "optim_bytes": 40500,
                                 "rank": 0}]  # ceil(rows / 1024) rows of every tensor, padded


# ------------------------------------------------------------------------------ activations
ACT_CASES = [
    (["model.name=gpt", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
      "model.vocab_size=100", "model.block_size=32"], 3),
    (["model.name=cnn"], 2),
    (["model.name=cnn", "model.batch_norm=true", "model.activation=relu", "model.pool=max",
      "model.channels=[8,16,8]"], 3),
    (["model.name=resnet", "model.width=0.125"], 2),
]


@pytest.mark.parametrize("overrides, micro", ACT_CASES, ids=["gpt", "cnn", "cnn-bn-relu", "resnet"])
@pytest.mark.parametrize("mode", ["fp32", "autocast", "half"])
def test_saved_activations_equal_autograds(overrides: list[str], micro: int, mode: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(ROOT / "benchmarks")  # the benchmark owns autograd's tracing
    from activation_memory import saved_bytes

    cfg = load_config(None, overrides)
    spec = spec_for(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, spec)
    x, y = batch(spec, micro)
    if mode == "half":
        model = model.bfloat16()
        x = x.bfloat16() if x.is_floating_point() else x
    est = activations.walk(activations.config_segments(cfg, micro, mode), checkpoint=False)
    assert est.saved == saved_bytes(model, x, y, mode)
    assert est.peak > est.saved
    ckpt = activations.walk(activations.config_segments(cfg, micro, mode), checkpoint=True)
    assert ckpt.saved < est.saved


def test_gpt_activations_follow_the_per_layer_formula() -> None:
    """fp32, no dropout, flash attention: 16 h floats per token per layer + norms + attention's
    log-sum-exp (Korthikanti et al.'s 34 s b h in 16 bits counts dropout masks and scores too)."""
    n_layer, h, heads, seq, vocab, b = 3, 64, 2, 16, 50, 4
    segs = activations.gpt_segments(n_layer, h, heads, seq, vocab, b, "fp32")
    per_block = 4 * (16 * b * seq * h + 4 * b * seq + b * heads * seq)
    assert all(s.saved == per_block for s in segs if s.block)
    half = activations.gpt_segments(n_layer, h, heads, seq, vocab, b, "half")
    assert half[1].saved == 32 * b * seq * h + 8 * b * seq + 4 * b * heads * seq


# ---------------------------------------------------------------------------- communication
def traffic(token: str, units: list[float], world: int, precision=FP32, **kw) -> float:
    plan = memory.parse_plan(token, world)
    return sum(c.traffic for c in comm.collectives(plan, units, precision, world, world, **kw))


def test_communication_volume_matches_the_ring_formulas() -> None:
    units, n = [1e6, 2e6, 3e6], 4
    p = g = 6e6 * 4
    assert traffic("ddp", units, n) == pytest.approx(2 * (n - 1) / n * g)
    assert traffic("zero2", units, n) == pytest.approx((n - 1) / n * (p + g))  # = ddp's
    assert traffic("zero3", units, n) == pytest.approx((n - 1) / n * (2 * p + g))
    assert traffic("zero3", units, n, reshard_after_forward=False) == pytest.approx((n - 1) / n * (p + g))
    s, r = 2, 2  # hybrid: FULL_SHARD in groups of 2, all-reduce of the shard over 2 groups
    assert traffic("hybrid:2", units, n) == pytest.approx((s - 1) / s * 3 * p + 2 * (r - 1) / r * g / s)
    # the same volumes dtlab's step breakdown predicts for its runs
    assert traffic("ddp", units, n) == pytest.approx(registry.get("ddp").comm_bytes({}, 6e6, 4, 4, n))
    assert traffic("zero3", units, n) == pytest.approx(registry.get("fsdp").comm_bytes({}, 6e6, 4, 4, n))
    assert traffic("zero3", units, n, reshard_after_forward=False) == pytest.approx(
        registry.get("fsdp1").comm_bytes({"sharding_strategy": "SHARD_GRAD_OP"}, 6e6, 4, 4, n))
    # gloo runs each reduce-scatter as an all-reduce; FSDP1 gathers its root unit once
    assert traffic("zero3", units, n, backend="gloo") == pytest.approx(
        (n - 1) / n * 2 * p + 2 * (n - 1) / n * g)
    root = 1e6
    plan = memory.parse_plan("zero3", n)
    fsdp1 = comm.collectives(plan, units, FP32, n, n, root=root, root_reshards=False)
    fsdp2 = comm.collectives(plan, units, FP32, n, n, root=root)
    assert sum(c.traffic for c in fsdp2) - sum(c.traffic for c in fsdp1) == pytest.approx(
        (n - 1) / n * root * 4)
    # torch's ZeroRedundancyOptimizer: DDP's all-reduce, then each rank broadcasts its part
    torch_zero1 = traffic("zero1", units, n, torch_zero1=True)
    assert torch_zero1 == pytest.approx(2 * (n - 1) / n * g + p)


def test_predicted_time_from_a_bandwidth_and_from_comm_results() -> None:
    units, n = [5e6] * 4, 8
    calls = comm.collectives(memory.parse_plan("zero3", n), units, FP32, n, n)
    links = comm.Links(bandwidth=50 * GB)
    assert comm.summarize(calls, links)["time_s"] == pytest.approx(
        sum(c.traffic for c in calls) / (50 * GB))
    from_json = comm.load_comm_results(ROOT / "docs/results/comm_all_2ranks.json")
    from_csv = comm.load_comm_results(ROOT / "docs/results/comm_all_2ranks.csv")
    rows = json.loads((ROOT / "docs/results/comm_all_2ranks.json").read_text())
    want = sum(c.calls * predict(fit(rows), c.op, c.size_bytes, c.ranks)["ring_s"] for c in calls)
    assert comm.summarize(calls, from_json)["time_s"] == pytest.approx(want)
    assert comm.summarize(calls, from_csv)["time_s"] == pytest.approx(want, rel=1e-6)


def test_estimate_of_a_config_uses_the_exact_layout() -> None:
    model = model_from_config(str(ROOT / "configs/fsdp_gpt.yaml"), [])
    assert model.n_params == 866_560
    setup = Setup(model, 2, 2, FP32, "adamw", micro=16)
    row = estimate(setup, "fsdp1")
    assert row["exact"] and row["per_rank"][0]["optim_bytes"] == 3_466_440
    assert row["params"] == 866_560 * 4 / 2
    assert estimate(setup, "zero3")["params"] == pytest.approx(866_560 * 4 / 2)  # ideal: unpadded


# ------------------------------------------------------------------------------------ advise
def advice(gpu_gb: float, gpus: int = 8, seq: int = 4096, micro: int = 1,
           host_gb: float | None = None) -> dict:
    model = model_from_size(7e9, None, None, None, seq, 32000)

    def make(ckpt: bool) -> Setup:
        return Setup(model, gpus, min(8, gpus), BF16, "adamw", micro, ckpt)

    return advise(make, gpu_gb * GB, host_bytes=host_gb * GB if host_gb else None)


@pytest.mark.parametrize("gpu_gb, strategy, ckpt", [
    (200, "ddp", False), (80, "zero1", False), (40, "zero3", False), (24, "zero3", True),
    (8, "zero3+offload", True),
])
def test_advice_takes_the_cheapest_layout_that_fits(gpu_gb: float, strategy: str, ckpt: bool) -> None:
    out = advice(gpu_gb)
    rec = out["recommendation"]
    assert (rec["strategy"], rec["checkpointing"]) == (strategy, ckpt)
    chosen = next(r for r in out["candidates"]
                  if (r["strategy"], r["checkpointing"]) == (strategy, ckpt))
    assert rec["headroom_bytes"] == pytest.approx(gpu_gb * GB - chosen["device_total"])
    assert rec["headroom_bytes"] > 0
    earlier = out["candidates"][:out["candidates"].index(chosen)]
    assert earlier and not any(r["fits"] for r in earlier) or strategy == "ddp"


def test_advice_beyond_data_parallelism() -> None:
    # 7B on 2 x 8 GB: zero3's state alone is 56 GB per GPU, and offloading it needs 112 GB of
    # host memory on the node, which has 64
    out = advice(8, gpus=2, host_gb=64)
    assert out["candidates"][-1]["host_per_node"] == pytest.approx(112 * GB)
    more_gpus = out["recommendation"]
    assert more_gpus["strategy"] is None and more_gpus["gpus_needed"] > 2
    tp = advice(80, gpus=64, seq=32768, micro=4)["recommendation"]  # activations do not fit
    assert tp["strategy"] == "zero3" and tp["model_parallel"] in (2, 4, 8)
    assert 0 < tp["per_gpu_bytes"] <= 80 * GB


def test_advise_command_prints_the_numbers() -> None:
    proc = dtlab("advise", "--n-params", "7e9", "--seq-len", "4096", "--precision", "bf16",
                 "--gpus", "8", "--gpu-memory", "40", "--bandwidth", "100")
    assert proc.returncode == 0, proc.stderr
    assert "advice: zero3 - 35.87 of 40.00 GB per GPU, headroom 4.13 GB (10%)" in proc.stdout


# -------------------------------------------------------------------------------- bad input
BAD = [
    (["estimate", "--n-params", "abc"], "argument --n-params: 'abc' is not a count"),
    (["estimate", "--n-params", "7e9", "--strategies", "zero9"], "'zero9' is not a strategy"),
    (["estimate", "--n-params", "7e9", "--world-size", "4", "--strategies", "hybrid:3"],
     "does not divide 4 ranks"),
    (["estimate", "--n-params", "7e9", "--strategies", "ddp+offload"], "nothing sharded"),
    (["estimate", "--n-params", "7e9", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["estimate", "--n-params", "7e9", "--world-size", "0"], "argument --world-size: '0' must be at least 1"),
    (["estimate", "--config", "configs/quick.yaml", "--n-params", "7e9"], "give one of them"),
    (["estimate"], "no model given"),
    (["estimate", "--config", "configs/quick.yaml", "--optimizer", "adamw"], "the config decides"),
    (["estimate", "--n-params", "7e9", "--comm-results", "missing.json"], "'missing.json' not found"),
    (["estimate", "--n-params", "7e9", "--comm-results", "configs/quick.yaml"],
     "is not a dtlab comm"),
    (["estimate", "--n-params", "7e9", "--comm-results", "x.json", "--bandwidth", "10"],
     "give one"),
    (["estimate", "--config", "configs/quick.yaml", "train.lrr=1"], "unknown config key"),
    (["advise", "--n-params", "7e9", "--gpus", "8"], "the following arguments are required: --gpu-memory"),
    (["advise", "--n-params", "7e9", "--gpus", "8", "--gpu-memory", "-1"], "argument --gpu-memory: '-1' must be above 0"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a[1:3]) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from dtlab.cli.main import main

    monkeypatch.chdir(ROOT)
    try:
        code = main(args)
    except SystemExit as e:  # a value its option's type refuses: argparse exits
        code = e.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("dtlab: error:") and err.count("\n") == 1, err
    assert message in err


def test_bad_input_through_the_real_command_has_no_traceback() -> None:
    proc = cli("estimate", "--n-params", "7e9", "--strategies", "zero9")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_config_estimate_reproduces_the_4_rank_measurements_of_strategies_md(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/strategies.md measured these on 4 ranks: fsdp 137,004 parameter bytes per rank
    (136,484 of optimizer state on the last), fsdp1 136,876. quick.yaml says `single`: the
    estimate splits its batch over the 4 ranks all the same."""
    from dtlab.cli.main import main

    monkeypatch.chdir(ROOT)
    assert main(["estimate", "--config", "configs/quick.yaml", "--world-size", "4",
                 "--strategies", "fsdp,fsdp1", "--json"]) == 0
    rows = {r["strategy"]: r["per_rank"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert [r["param_bytes"] for r in rows["fsdp"]] == [137_004] * 4
    assert rows["fsdp"][3]["optim_bytes"] == 136_484
    assert [r["param_bytes"] for r in rows["fsdp1"]] == [136_876] * 4
