"""The collectives dtlab predict says a step issues, against those a real step issues (issue 28).

One pair of real gloo ranks trains every strategy for a few steps of a tiny GPT, one after the
other in the same two processes (tests/ranks.py; a process group per run), each rank writing
the collectives of its last step (DTLAB_RECORD_STEP: the flight recorder, plus dtlab's own record
of what gloo leaves out, see dtlab/predict/truth.py). The prediction traces the same step under
the recording fake process group (dtlab.predict.trace); both must agree per rank: count, op,
bytes and group size. The recorded side is also checked on its own (bytes that must add up to
the model's gradient or parameter bytes, sends that meet their receives).
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import ranks

from dtlab.config import load_config
from dtlab.config.strategies.registry import parse as parse_spec
from dtlab.predict.trace import collectives_of, trace_step
from dtlab.predict.truth import (
    recorded_collectives,
    run_args,
    split_alone,
)

STEPS = 3  # DDP rebuilds its buckets in step 2 (broadcasts a steady step does not make)
GPT_TINY = ["model.name=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
            "model.block_size=16", "model.vocab_size=64", "data.synthetic.train_samples=256",
            "data.synthetic.val_samples=32", "train.global_batch_size=8", "train.grad_clip=1.0"]
SPECS = ["ddp", "fsdp", "fsdp1", "zero1", "hsdp", "tp", "fsdp_tp", "pp", "deepspeed:1",
         "deepspeed:2", "deepspeed:3", "ddp+accum", "fsdp+ac"]
VARIANTS = {"accum": ["train.grad_accum_steps=2"],  # no-sync micro steps
            "ac": ["train.activation_checkpointing=full"]}  # the recompute's all-gathers
HAS_DS = importlib.util.find_spec("deepspeed") is not None


def every_run(argv: list[str]) -> int:
    """A rank's target: dtlab.train's entry point once per run, in order (argv: a JSON list of
    (port, arguments)); the first failure's exit code. Each run's process group meets on a port
    of its own (ranks.stores: served by the test's process)."""
    import os

    from dtlab.strategies.deepspeed import forget_groups
    from dtlab.train import main

    for port, args in json.loads(argv[0]):
        os.environ["MASTER_PORT"] = str(port)
        forget_groups()  # DeepSpeed keeps the last run's (destroyed) groups in its globals
        code = main(args)
        if code:
            return code
    return 0


def args_of(spec: str, run_dir: Path) -> list[str]:
    return run_args(None, overrides_of(spec), STEPS, run_dir, warmup=1)


def overrides_of(spec: str) -> list[str]:
    """A strategy spec, +variant: the tiny GPT's overrides."""
    strategy, _, variant = spec.partition("+")
    return [*GPT_TINY, *parse_spec(strategy), *VARIANTS.get(variant, [])]


def specs() -> list[str]:
    return [s for s in SPECS if HAS_DS or not s.startswith("deepspeed")]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, list]]:
    root = tmp_path_factory.mktemp("collectives")
    runs = {spec: root / spec.replace(":", "-").replace("+", "-") for spec in specs()}
    served = ranks.stores(len(runs))  # referenced until the ranks are done
    plan = list(zip([s.port for s in served], [args_of(s, d) for s, d in runs.items()],
                    strict=True))
    proc = ranks.start(2, [json.dumps(plan)],
                       target=every_run, env={"DTLAB_RECORD_STEP": str(STEPS)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {spec: recorded_collectives(run_dir, STEPS, 2) for spec, run_dir in runs.items()}


def gradient_bytes() -> int:
    from dtlab.data import spec_for
    from dtlab.models import build_model, count_params

    cfg = load_config(None, GPT_TINY)
    return 4 * count_params(build_model(cfg.model, spec_for(cfg), cfg.train.lora))


def total(collectives: list, op: str) -> int:
    return sum(b for o, b, _ in collectives if o == op)


def test_recorded_steps_add_up_to_the_model(recorded: dict[str, dict[int, list]]) -> None:
    """A real step's recorded collectives carry the model's bytes: DDP and ZeRO-1 all-reduce every
    gradient once, ZeRO-1 broadcasts every parameter from its owner, FSDP1/2 reduce-scatter every
    gradient (renamed from gloo's all-reduce), DeepSpeed 1/2 all-gather every parameter; with
    two accumulation micro steps DDP still all-reduces once."""
    grads = gradient_bytes()
    for spec, by_rank in recorded.items():
        assert by_rank[0] and by_rank[0] == by_rank[1] or spec == "pp", spec  # symmetric ranks
        assert all(0 < size <= 2 for rank in by_rank.values() for _, _, size in rank), spec
    assert recorded["ddp"][0] == [("all_reduce", grads, 2)]  # one bucket: the whole gradient
    assert recorded["ddp+accum"] == recorded["ddp"]  # the first micro step does not sync
    assert total(recorded["zero1"][0], "all_reduce") == grads
    assert total(recorded["zero1"][0], "broadcast") == grads
    for spec in ("fsdp", "fsdp1"):
        assert total(recorded[spec][0], "reduce_scatter") == grads
        assert {op for op, _, _ in recorded[spec][0]} == {"all_gather", "reduce_scatter",
                                                         "all_reduce"}  # + the gradient norm
    for stage in (1, 2):
        if f"deepspeed:{stage}" in recorded:
            assert total(recorded[f"deepspeed:{stage}"][0], "all_gather") == grads


def test_pipeline_sends_meet_their_receives(recorded: dict[str, dict[int, list]]) -> None:
    """Each pipeline send recorded on one rank is a receive of the same bytes on the other (gloo's
    flight recorder keeps no point-to-point call: dtlab records them itself)."""
    pp = recorded["pp"]
    for a, b in ((0, 1), (1, 0)):
        sent = Counter(n for op, n, _ in pp[a] if op == "send")
        assert sent and sent == Counter(n for op, n, _ in pp[b] if op == "recv")


@pytest.mark.parametrize("spec", SPECS)
def test_predicted_collectives_equal_a_real_step(recorded: dict[str, dict[int, list]],
                                                 spec: str) -> None:
    """The collectives traced under the fake process group at 2 ranks equal those a real 2-rank
    step issues, rank by rank: count, op, bytes and group size, in issue order (those over a
    group of one rank, which move nothing, the trace counts apart: as many)."""
    if spec not in recorded:
        pytest.skip("deepspeed not installed: pip install 'dtlab[deepspeed]'")
    cfg = load_config(None, overrides_of(spec))
    for rank in (0, 1):
        trace = trace_step(cfg, 2, rank, 2, device="cpu")
        moving, alone = split_alone(recorded[spec][rank])
        assert collectives_of(trace) == moving, f"{spec} rank {rank}"
        assert trace.meta["alone"] == alone, f"{spec} rank {rank}"


def fr_entry(name: str, t: int, inputs: list[list[int]], dtype: str = "Float",
             group: str = "0") -> dict:
    return {"profiling_name": f"gloo:{name}", "time_created_ns": t, "input_sizes": inputs,
            "input_dtypes": [dtype] * len(inputs), "process_group": [group, ""]}


def test_a_step_record_becomes_nccl_tests_sizes_in_issue_order() -> None:
    """A rank's step record turns into nccl-tests sizes in issue order: an all-gather counts its
    gathered output, a coalesced call its summed inputs, gloo's all-reduce made inside a
    reduce-scatter call is that reduce-scatter, and sends and receives (absent from gloo's record)
    come from dtlab's own record; a step the ring buffer could not hold is refused."""
    from dtlab.errors import RunError
    from dtlab.predict.truth import step_collectives

    record = {"rank": 0, "step": 3, "pg_config": {"0": {"ranks": "[0, 1, 2, 3]"},
                                                  "5": {"ranks": "[0, 2]"}},
              "entries": [fr_entry("all_gather", 10, [[8, 2]], "BFloat16"),
                          fr_entry("all_reduce", 20, [[4], [6]]),
                          fr_entry("all_reduce", 31, [[16]], group="5"),
                          fr_entry("broadcast", 50, [[]], "Long")],
              "own": [{"op": "reduce_scatter", "bytes": 64, "peer": None, "start_ns": 30,
                       "end_ns": 32},
                      {"op": "send", "bytes": 12, "peer": 1, "start_ns": 40, "end_ns": 41}]}
    assert step_collectives(record) == [("all_gather", 128, 4), ("all_reduce", 40, 4),
                                        ("reduce_scatter", 64, 2), ("send", 12, 2),
                                        ("broadcast", 8, 4)]
    with pytest.raises(RunError, match="more collectives than the flight recorder keeps"):
        step_collectives({**record, "entries_lost": True})


def test_a_3d_pipelines_predicted_collectives_and_sends_equal_a_real_step(tmp_path: Path) -> None:
    """single@pp2.tp2 on 4 real ranks (2 stages, each tensor-parallel over 2): every rank's
    collectives over its tensor-parallel pair and its sends and receives to the other stage, as
    traced at 4 ranks under the fake process group."""
    spec, run_dir = "single@pp2.tp2", tmp_path / "pp2-tp2"
    (served,) = ranks.stores(1)
    proc = ranks.start(4, [json.dumps([[served.port, args_of(spec, run_dir)]])],
                       target=every_run, env={"DTLAB_RECORD_STEP": str(STEPS)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recorded = recorded_collectives(run_dir, STEPS, 4)
    cfg = load_config(None, overrides_of(spec))
    for rank in range(4):
        ops = {op for op, _, _ in recorded[rank]}
        assert {"send", "recv"} <= ops and ops & {"all_gather", "reduce_scatter"}, ops
        trace = trace_step(cfg, 4, rank, 4, device="cpu")
        moving, alone = split_alone(recorded[rank])
        assert collectives_of(trace) == moving, f"rank {rank}"
        assert trace.meta["alone"] == alone, f"rank {rank}"
