"""dtlab predict's trace: one step of dtlab's own strategy classes under the recording fake
process group, in this process (no ranks started): the collectives each wrapper issues, where it
waits for them, and the compute between."""

from __future__ import annotations

import pytest

from dtlab.config import load_config
from dtlab.config.strategies.registry import parse
from dtlab.errors import ConfigError
from dtlab.estimate.measure import meta_model
from dtlab.models import count_params
from dtlab.predict.events import Compute, Issue, Wait
from dtlab.predict.trace import collectives_of, trace_step, traced_ranks

GPT = ["model.name=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
       "model.block_size=16", "model.vocab_size=64", "train.global_batch_size=8"]


def config(spec: str, *overrides: str):
    return load_config(None, [*GPT, *overrides, *parse(spec)])


def trace(spec: str, *overrides: str, world: int = 2, rank: int = 0, device: str = "cpu"):
    return trace_step(config(spec, *overrides), world, rank, world, device=device)


def waits_follow_issues(events) -> bool:
    issued: set[int] = set()
    for e in events:
        if isinstance(e, Issue):
            issued.add(e.id)
        elif isinstance(e, Wait) and e.id not in issued:
            return False
    return True


def test_ddp_all_reduces_every_gradient_byte_in_its_buckets() -> None:
    """ddp at 2 ranks: the all-reduces of a step carry the gradient bytes, bucket by bucket, each waited after it is issued."""
    cfg = config("ddp", "strategy.ddp.bucket_cap_mb=0.05")
    t = trace_step(cfg, 2, 0, 2, device="cpu")
    reduces = [c for c in collectives_of(t) if c[0] == "all_reduce"]
    assert len(reduces) >= 2  # 120 kB of gradients in 50 kB buckets
    assert sum(b for _, b, _ in reduces) == 4 * count_params(meta_model(cfg))
    assert all(n == 2 for *_, n in reduces)
    assert waits_follow_issues(t.events)
    assert {e.id for e in t.events if isinstance(e, Wait)} == {e.id for e in t.issues()}
    assert all(e.phase == "backward" for e in t.issues())
    # measured on this CPU: every stretch that counted FLOPs has its seconds
    assert all(c.seconds is not None and c.seconds > 0 for c in t.computes() if c.flops)
    assert t.meta["strategy"] == "ddp" and t.meta["world"] == 2 and t.meta["micro_batch"] == 4


def test_ddp_accumulation_micro_steps_issue_nothing() -> None:
    """ddp with gradient accumulation: no collective in the first (no_sync) micro step, the all-reduces in the last."""
    t = trace("ddp", "train.grad_accum_steps=2", device="cpu")
    assert {e.micro for e in t.issues()} == {1}
    assert {c.micro for c in t.computes() if c.phase == "forward" and c.flops} == {0, 1}


def test_ddp_fp16_compression_hook_halves_the_bytes() -> None:
    """ddp's fp16 communication hook: the all-reduce carries half the bytes of the plain one."""
    plain = sum(b for _, b, _ in collectives_of(trace("ddp")))
    half = sum(b for _, b, _ in collectives_of(trace("ddp", "strategy.ddp.comm_hook=fp16")))
    assert half * 2 == plain


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_gathers_and_reduce_scatters_each_unit(reshard: bool) -> None:
    """fsdp at 2 ranks: one all-gather per unit in the forward (again in the backward when resharding after forward) and one reduce-scatter per unit, of the unit's bytes."""
    cfg = config("fsdp", f"strategy.fsdp.reshard_after_forward={str(reshard).lower()}")
    t = trace_step(cfg, 2, 0, 2, device="cpu")
    model = meta_model(cfg)
    blocks = [4 * sum(p.numel() for p in b.parameters()) for b in model.blocks()]
    units = sorted([*blocks, 4 * count_params(model) - sum(blocks)])
    forward = [e for e in t.issues() if e.op == "all_gather" and e.phase == "forward"]
    backward = [e for e in t.issues() if e.op == "all_gather" and e.phase == "backward"]
    scatters = [e for e in t.issues() if e.op == "reduce_scatter"]
    assert sorted(e.bytes for e in forward) == units
    assert sorted(e.bytes for e in scatters) == units
    assert sorted(e.bytes for e in backward) == (units if reshard else [])
    assert waits_follow_issues(t.events)


def test_tensor_parallel_blocks_issue_the_same_collectives() -> None:
    """tp at 2 ranks: every block's forward and backward issue the same collectives in its tensor-parallel group."""
    t = trace("tp", device="cpu")
    per_block = [[(e.op, e.bytes) for e in t.issues() if e.block == b and e.phase == phase]
                 for b in (0, 1) for phase in ("forward", "backward")]
    assert per_block[0] and per_block[0] == per_block[2]
    assert per_block[1] and per_block[1] == per_block[3]
    assert {e.group for e in t.issues()} == {(0, 1)}
    assert waits_follow_issues(t.events)


def test_pipeline_sends_meet_their_receives() -> None:
    """pp (1f1b) at 2 ranks: both stages are traced, and every send of one has the matching receive on the other."""
    cfg = config("pp:1f1b@2", "strategy.pp.microbatches=2")
    assert traced_ranks(cfg, 2, 2) == [0, 1]
    sends, recvs = [], []
    for r in (0, 1):
        t = trace_step(cfg, 2, r, 2, device="cpu")
        sends += [(e.group, e.bytes) for e in t.issues() if e.op == "send"]
        recvs += [(e.group, e.bytes) for e in t.issues() if e.op == "recv"]
        assert waits_follow_issues(t.events)
    assert sends and sorted(sends) == sorted(recvs)
    assert traced_ranks(config("ddp"), 2, 2) == [0]


def test_recompute_is_its_own_phase() -> None:
    """Activation checkpointing: each checkpointed block's forward runs again in its backward, as recompute (up to the forward's FLOPs: torch stops once the saved tensors are back)."""
    t = trace("fsdp", "train.activation_checkpointing=full", device="cpu")
    flops = {(c.phase, c.block): 0.0 for c in t.computes()}
    for c in t.computes():
        flops[(c.phase, c.block)] += c.flops
    for b in (0, 1):
        assert 0 < flops[("recompute", b)] <= flops[("forward", b)]


def test_deepspeed_engine_runs_under_the_recording_group() -> None:
    """deepspeed ZeRO 2 at 2 ranks: its engine's own step is traced (its collectives and waits)."""
    pytest.importorskip("deepspeed")
    t = trace("deepspeed:2", device="cpu")
    assert t.issues() and waits_follow_issues(t.events)
    assert any(e.phase == "backward" for e in t.issues())


def test_deepspeed_zero3_trace_leaves_the_process_as_it_was() -> None:
    """ZeRO-3 traced at rank 1 of 2: its patched F.linear and rank variables are undone after."""
    pytest.importorskip("deepspeed")
    import os

    import torch

    linear, environ = torch.nn.functional.linear, {k: os.environ.get(k) for k in
                                                   ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t = trace_step(config("deepspeed:3"), 2, 1, 2, device="cpu")
    assert t.issues() and waits_follow_issues(t.events)
    assert torch.nn.functional.linear is linear
    assert {k: os.environ.get(k) for k in environ} == environ


@pytest.mark.parametrize("stage", [2, 3])  # 1 takes 2's code path (stage_1_and_2.py)
def test_deepspeed_on_the_meta_device_issues_the_collectives_of_a_real_step(stage: int) -> None:
    """deepspeed at 2 ranks traced without values (a GPU cluster's roofline prediction): its
    host reads of norms and overflow flags see a healthy step, ZeRO-3 settles its prefetch in
    warm-up steps, and the collectives are those of the CPU trace, which equal a real step's
    (test_predict_collectives.py); its gradient bucket's views move no bytes."""
    pytest.importorskip("deepspeed")
    meta, cpu = trace(f"deepspeed:{stage}", device="meta"), trace(f"deepspeed:{stage}")
    assert collectives_of(meta) == collectives_of(cpu) and collectives_of(meta)
    assert waits_follow_issues(meta.events)
    moved, counted = sum(c.bytes for c in meta.computes()), sum(c.bytes for c in cpu.computes())
    assert 0 < moved < 1e8  # the 2-GB bucket it narrows per parameter is counted nowhere
    assert moved == pytest.approx(counted, rel=0.05)


def test_views_and_allocations_move_no_bytes() -> None:
    """The roofline's bytes: a view of a large tensor and an uninitialised buffer count nothing,
    a copy counts what it reads and writes."""
    import torch

    from dtlab.predict.counting import CountingMode
    from dtlab.predict.recorder import RECORDER

    big = torch.zeros(1 << 20)
    RECORDER.start(timed=False, sync=lambda: None)
    try:
        with CountingMode():
            RECORDER.bytes = 0
            big.narrow(0, 0, 16)
            big.view(1024, 1024).t()
            torch.empty(1 << 20)
            viewed = RECORDER.bytes
            big[:256].clone()
            copied = RECORDER.bytes - viewed
    finally:
        RECORDER.stop()
    assert viewed == 0
    assert copied == 2 * 256 * 4


def test_a_world_the_strategy_cannot_take_is_refused() -> None:
    """A world size the global batch does not split over is refused with the fix, as dtlab train refuses it."""
    with pytest.raises(ConfigError, match="global_batch_size"):
        trace_step(config("ddp"), 3, 0, 3)
    assert isinstance(Compute("forward"), Compute)


@pytest.mark.parametrize("spec,overrides", [
    ("ddp", ["strategy.ddp.bucket_cap_mb=0.01", "train.grad_accum_steps=2"]),
    ("fsdp", ["train.activation_checkpointing=full"]),
    ("zero1", []),
    ("hsdp", ["strategy.hsdp.shard_size=2"]),
])
def test_meta_trace_issues_the_cpu_traces_collectives(spec: str, overrides: list[str]) -> None:
    """A trace on the meta device (no weights) issues the collectives of a cpu trace, in order, with the same FLOPs per Compute and no seconds, at 4 ranks; the cpu trace, timed on its thread's CPU clock as 4 ranks on fewer cores are, says so."""
    cfg = config(spec, *overrides)
    cpu, meta = (trace_step(cfg, 4, 0, 4, device=d, cpu_clock=True) for d in ("cpu", "meta"))
    assert (cpu.meta["clock"], meta.meta["clock"]) == ("thread cpu", "wall")
    assert all(c.seconds is not None and c.seconds >= 0 for c in cpu.computes())
    assert len(collectives_of(cpu)) > 1 and collectives_of(meta) == collectives_of(cpu)
    assert ([(c.phase, c.block, c.micro, c.flops) for c in meta.computes() if c.flops]
            == [(c.phase, c.block, c.micro, c.flops) for c in cpu.computes() if c.flops])
    assert all(c.seconds is None for c in meta.computes())
    assert waits_follow_issues(meta.events) and meta.meta["device"] == "meta"


def test_zero1s_broadcasts_are_one_burst_and_ddps_buckets_none() -> None:
    """zero1 at 2 ranks: after the step, one broadcast per parameter, issued back to back: a burst
    (the link's burst factor prices them); ddp's bucket all-reduces, issued between stretches of
    the backward, are no burst. Read on the meta device, which has no timings: on a measured
    trace, what counts as back to back depends on how long this CPU took between two calls
    (mark_arrivals' ON_ITS_OWN_S, tested on recorded timings in test_predict_cluster.py), so
    the CPU trace is checked for what holds at any speed: the same calls, in the same order,
    after the optimizer's compute, with no wait between them."""
    cfg = config("zero1")
    meta = trace_step(cfg, 2, 0, 2, device="meta")
    casts = [e for e in meta.issues() if e.op == "broadcast"]
    assert len(casts) == len(list(meta_model(cfg).parameters())) > 2
    assert all(e.in_burst for e in casts)
    cpu = trace_step(cfg, 2, 0, 2, device="cpu")
    assert [(e.op, e.bytes) for e in cpu.issues()] == [(e.op, e.bytes) for e in meta.issues()]
    at = [i for i, e in enumerate(cpu.events) if isinstance(e, Issue) and e.op == "broadcast"]
    assert any(isinstance(e, Compute) and e.phase == "optimizer" for e in cpu.events[:at[0]])
    assert not any(isinstance(e, Wait) for e in cpu.events[at[0]:at[-1]])
    ddp = trace_step(config("ddp", "strategy.ddp.bucket_cap_mb=0.01"), 2, 0, 2, device="meta")
    assert len(ddp.issues()) > 2 and not any(e.in_burst for e in ddp.issues())


def test_meta_trace_allocates_no_weights() -> None:
    """A 0.9-billion-parameter GPT traced on the meta device under ddp at 4 ranks: its weights, gradients and Adam state (15 GB) are never allocated."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = load_config(None, ["model.name=gpt", "model.n_layer=2", "model.n_embd=4096",
                             "model.n_head=32", "model.block_size=32", "model.vocab_size=65536",
                             "train.global_batch_size=4", "train.optimizer=adamw", *parse("ddp")])
    t = trace_step(cfg, 4, 0, 4, device="meta")
    assert t.meta["n_params"] > 900_000_000
    assert sum(b for _, b, _ in collectives_of(t)) == 4 * t.meta["n_params"]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1_000_000  # kB


def test_a_group_of_one_rank_is_left_out() -> None:
    """hsdp at 2 ranks in one shard group: the all-reduce over its group of one replica moves nothing, so it is counted in meta["alone"], not recorded; the rest are fsdp's collectives."""
    for device in ("cpu", "meta"):
        t = trace("hsdp", device=device)
        assert t.meta["alone"] > 0 and all(len(e.group) == 2 for e in t.issues())
        assert collectives_of(t) == collectives_of(trace("fsdp", device=device))
        assert waits_follow_issues(t.events)


LLAMA = ["model.name=hf", "model.hf.config.model_type=llama", "model.hf.config.vocab_size=128",
         "model.hf.config.hidden_size=64", "model.hf.config.intermediate_size=128",
         "model.hf.config.num_hidden_layers=2", "model.hf.config.num_attention_heads=4",
         "model.hf.config.num_key_value_heads=2", "model.hf.config.max_position_embeddings=64",
         "model.hf.config.tie_word_embeddings=false", "model.block_size=32",
         "train.global_batch_size=8"]


def step_shape(t) -> list[tuple]:
    """Issues, Waits (by issue order) and the Computes that counted FLOPs, in step order."""
    order: dict[int, int] = {}
    out: list[tuple] = []
    for e in t.events:
        if isinstance(e, Issue):
            order[e.id] = len(order)
            out.append(("issue", e.op, e.bytes, e.group, e.phase, e.block, e.micro))
        elif isinstance(e, Wait):
            out.append(("wait", order[e.id]))
        elif e.flops:
            out.append(("compute", e.phase, e.block, e.micro, e.flops))
    return out


@pytest.mark.parametrize("model,spec,world", [
    ("gpt", "tp", 4), ("gpt", "fsdp_tp@2x2", 4), ("llama", "tp", 2), ("llama", "fsdp_tp@2x2", 4)])
def test_meta_trace_of_tensor_parallel_is_the_cpu_trace(model: str, spec: str, world: int) -> None:
    """tp and fsdp_tp (a GPT and a Hugging Face Llama) traced on the meta device: the functional collectives of DTensor are issued and waited where a cpu trace has them, with its FLOPs per Compute (the sharding propagation's global shapes uncounted)."""
    if model == "llama":
        pytest.importorskip("transformers")
    base = [*GPT, "model.n_head=4"] if model == "gpt" else LLAMA
    cfg = load_config(None, [*base, *parse(spec)])
    cpu, meta = (trace_step(cfg, world, 0, world, device=d) for d in ("cpu", "meta"))
    assert len(collectives_of(cpu)) > 10 and collectives_of(meta) == collectives_of(cpu)
    assert step_shape(meta) == step_shape(cpu)
    assert waits_follow_issues(meta.events)


@pytest.mark.parametrize("spec", ["ddp", "fsdp", "tp"])
def test_trace_holds_the_strategys_state_bytes(spec: str) -> None:
    """A trace, on cpu and on meta, holds the traced rank's parameter, gradient and optimizer bytes (the strategy's own state_bytes), as dtlab estimate measures them."""
    import torch

    from dtlab.estimate.measure import measure_rank

    cfg = config(spec, "train.optimizer=adamw")
    expected = measure_rank(cfg, 0, 2, 2, torch.device("cpu"))[0]
    expected.pop("rank")
    assert expected["optim_bytes"] > expected["param_bytes"] > 0
    for device in ("cpu", "meta"):
        assert trace(spec, "train.optimizer=adamw", device=device).meta["state_bytes"] == expected
