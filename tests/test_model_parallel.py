"""Tensor, pipeline and 2-D parallelism on a tiny GPT (CPU, gloo, fp32), against `single`.

One `dtlab compare --verify` runs single, tp on 2 ranks, pp on 2 ranks with each schedule, fsdp_tp
on a 2x2 mesh and pp on a 2x2 mesh (pipelines of 2, replicas synchronised by DDP): per-step losses
and the gathered final parameters agree with single within 1e-4 (relative) over 10 steps; the
parameter bytes per rank show the split; a pp checkpoint resumes under tp; bad meshes and models
are refused with exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ranks
import torch
from conftest import CONFIGS, dtlab, fast_launches, max_rel_dev, step_losses, train

from dtlab.cli.compare import param_deviation, parse_spec, run_label, spec_ranks
from dtlab.cli.main import main
from dtlab.config import load_config
from dtlab.config.strategies.registry import label as strategy_label
from dtlab.errors import ConfigError
from dtlab.models import GPT

STEPS = 10
TOL = 1e-4
GPT_TINY = ["model.name=gpt", "model.n_layer=4", "model.n_head=4", "model.n_embd=64",
            "model.block_size=32", "model.vocab_size=128", "data.synthetic.train_samples=512",
            "data.synthetic.val_samples=64", "train.global_batch_size=16", "train.lr=0.1",
            f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.grad_clip=1.0"]
SPECS = ["tp", "pp:gpipe", "pp:1f1b", "pp:interleaved_1f1b", "pp:looped_bfs", "fsdp_tp@2x2",
         "pp:1f1b@2x2"]


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    out = session_dir / "model-parallel"
    with fast_launches():
        proc = dtlab("compare", "--strategies", ",".join(["single", *SPECS]), "--nproc-per-node",
                     "2", "--verify", "--tolerance", str(TOL), "--out", str(out), *GPT_TINY,
                     "strategy.pp.dp=ddp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"verify passed: {STEPS} steps vs single" in proc.stdout
    return out


def summary(runs: Path, spec: str) -> dict:
    return json.loads((runs / run_label(spec) / "summary.json").read_text())


def test_each_run_names_its_layout(runs: Path) -> None:
    """summary.json's layout: the data-parallel flavour @ the model-parallel degrees, whichever
    shorthand started the run (config/layout.py)."""
    layouts = {spec: summary(runs, spec)["layout"] for spec in ["single", *SPECS]}
    assert layouts == {"single": "single", "tp": "single@tp2", "pp:gpipe": "single@pp2",
                       "pp:1f1b": "single@pp2", "pp:interleaved_1f1b": "single@pp2",
                       "pp:looped_bfs": "single@pp2", "fsdp_tp@2x2": "fsdp@tp2",
                       "pp:1f1b@2x2": "ddp@pp2"}


@pytest.mark.parametrize("spec", SPECS)
def test_losses_and_parameters_match_single(runs: Path, spec: str) -> None:
    ref = step_losses(runs / "single")
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.3  # it trained
    assert max_rel_dev(step_losses(runs / run_label(spec)), ref) < TOL
    dev = param_deviation(runs / run_label(spec) / "model.safetensors",
                          runs / "single" / "model.safetensors")
    assert dev < TOL  # the same keys as single's state dict, gathered from every shard and stage
    s = summary(runs, spec)
    assert s["world_size"] == spec_ranks(spec, 2) and s["tokens_per_s"] > 0


def expected_stage_bytes(blocks: list[list[int]], ranks: int) -> list[int]:
    """fp32 bytes of each pipeline rank's parameters: its blocks, embeddings on stage 0, the
    final norm and head on the last stage (loop placement: stage s on rank s % ranks)."""
    cfg = load_config(None, GPT_TINY).model
    model = GPT(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size)
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters()}

    def owned(name: str, stages: list[int]) -> bool:
        if name.startswith("h."):
            return any(int(name.split(".")[1]) in blocks[s] for s in stages)
        return (0 in stages) if name.startswith(("wte", "wpe")) else (len(blocks) - 1 in stages)

    per_rank = [[s for s in range(len(blocks)) if s % ranks == r] for r in range(ranks)]
    return [sum(b for n, b in sizes.items() if owned(n, stages)) for stages in per_rank]


def test_parameter_bytes_show_the_split(runs: Path) -> None:
    full = summary(runs, "single")["memory_per_rank"]["param_bytes"][0]
    assert full == summary(runs, "single")["n_params"] * 4
    # TP: every weight matrix and embedding is split in two; norms and row-parallel biases
    # (under 1% of this model) are replicated. Gradients and optimizer state follow (SGD momentum:
    # one buffer per parameter), also those of the embeddings (DTensor makes their gradients full
    # size; tp.py slices them back).
    tp = summary(runs, "tp")["memory_per_rank"]
    for key in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert all(full / 2 <= b <= 0.51 * full for b in tp[key]), (key, tp[key])
    # FSDP x TP on 2x2: a quarter each (FSDP pads shards to even sizes).
    assert all(full / 4 <= b <= 0.27 * full for b in summary(runs, "fsdp_tp@2x2")
               ["memory_per_rank"]["param_bytes"])
    # PP: each rank holds exactly its stages' parameters.
    two = expected_stage_bytes([[0, 1], [2, 3]], 2)  # gpipe, 1f1b: 2 stages of 2 blocks
    four = expected_stage_bytes([[0], [1], [2], [3]], 2)  # 2 stages per rank: blocks 0+2, 1+3
    assert sum(two) == sum(four) == full
    for spec, expected in [("pp:gpipe", two), ("pp:1f1b", two), ("pp:interleaved_1f1b", four),
                           ("pp:looped_bfs", four), ("pp:1f1b@2x2", two + two)]:
        assert summary(runs, spec)["memory_per_rank"]["param_bytes"] == expected, spec


def test_pipeline_bubble_is_measured(runs: Path) -> None:
    for spec, stages_per_rank in [("pp:gpipe", 1), ("pp:1f1b", 1), ("pp:interleaved_1f1b", 2)]:
        s = summary(runs, spec)
        pipe = s["pipeline"]
        p, m, v = 2, 4, stages_per_rank
        assert pipe["ranks"] == p and pipe["microbatches"] == m and pipe["stages"] == p * v
        assert pipe["bubble_theory"] == pytest.approx((p - 1) / (v * m + p - 1))
        assert all(0 <= b < 1 for b in pipe["bubble_measured_per_rank"]), pipe
        assert all(0 < busy < wall for busy, wall in zip(pipe["busy_s_per_step_per_rank"],
                                                          pipe["wall_s_per_step_per_rank"],
                                                          strict=True))
        assert s["strategy_options"]["schedule"] == spec.split(":")[1]
    assert summary(runs, "pp:1f1b@2x2")["strategy_options"]["dp"] == "ddp"
    assert strategy_label(summary(runs, "pp:1f1b@2x2")) == "pp:1f1b@2x2"
    assert strategy_label(summary(runs, "fsdp_tp@2x2")) == "fsdp_tp@2x2"


def test_compare_specs() -> None:
    assert parse_spec("pp:interleaved_1f1b") == ["strategy.name=pp",
                                                 "strategy.pp.schedule=interleaved_1f1b"]
    assert parse_spec("fsdp_tp@2x2") == ["strategy.name=fsdp_tp", "strategy.tp.degree=2"]
    assert parse_spec("pp:gpipe@4") == ["strategy.name=pp", "strategy.pp.schedule=gpipe",
                                        "strategy.pp.degree=4"]
    assert spec_ranks("fsdp_tp@2x2", 2) == 4 and spec_ranks("tp", 2) == 2
    assert spec_ranks("single", 2) == 1 and run_label("pp:gpipe@2x2") == "pp-gpipe-2x2"
    for bad, match in [("ddp@2", "only tp, fsdp_tp, pp(, [a-z_]+)* take a mesh shape"),
                       ("tp@2x", "bad mesh shape"), ("pp:zigzag", "pp a schedule")]:
        with pytest.raises(ConfigError, match=match):
            parse_spec(bad)


def test_checkpoints_move_between_strategies(runs: Path, session_dir: Path) -> None:
    """A pp run's DCP checkpoint (each rank writes its own stages, under the whole model's names)
    resumes under tp, which continues exactly as single did."""
    a, b = session_dir / "pp-ckpt", session_dir / "tp-resumed"
    train(a, *GPT_TINY, "strategy.name=pp", "train.checkpoint_every=5", nproc=2)
    summary = train(b, *GPT_TINY, "strategy.name=tp", f"resume={a}/checkpoints/step_000005",
                    "run.save_model=true", nproc=2)
    assert summary["resumed_from"]["step"] == 5
    assert max_rel_dev(step_losses(b), step_losses(runs / "single")[5:]) < TOL
    assert param_deviation(b / "model.safetensors", runs / "single" / "model.safetensors") < TOL


REFUSED = [
    # (ranks, overrides, text the one-line message must contain)
    (2, ["strategy.name=tp"], "splits the layers of a GPT or a Llama-family Hugging Face model, "
                              "not model.name=cnn"),
    (4, ["strategy.name=fsdp_tp", "strategy.tp.degree=3"],
     "strategy.tp.degree=3 does not divide world_size=4"),
    (4, ["strategy.name=pp", "strategy.pp.degree=3"],
     "strategy.pp.degree=3 does not divide world_size=4"),
    (4, ["strategy.name=tp", "strategy.tp.degree=2"], "or strategy.name=fsdp_tp"),
    (2, ["strategy.name=tp", "model.n_head=3", "model.n_embd=96"],
     "model.n_head=3 is not divisible by the tensor-parallel degree 2"),
    (4, ["strategy.name=fsdp_tp", "strategy.tp.degree=4", "model.n_head=6", "model.n_embd=96"],
     "model.n_head=6 is not divisible by the tensor-parallel degree 4"),
    (2, ["strategy.name=pp", "model.n_layer=3", "strategy.pp.schedule=looped_bfs"],
     "4 pipeline stages, more than model.n_layer=3"),
    (2, ["strategy.name=pp", "strategy.pp.microbatches=3"],
     "does not split into strategy.pp.microbatches=3"),
    (4, ["strategy.name=pp", "strategy.pp.microbatches=2"], "microbatches=2 >= the pipeline"),
    (2, ["strategy.name=pp", "strategy.pp.stages_per_rank=2"], "runs one stage per rank"),
    (2, ["strategy.name=pp", "model.tie_weights=true"], "model.tie_weights"),
    (2, ["strategy.name=tp", "train.compile=true"], "train.compile=model is not supported"),
]


@pytest.mark.parametrize(("ranks", "overrides", "expected"), REFUSED,
                         ids=[" ".join(o) for _, o, _ in REFUSED])
def test_bad_mesh_or_model_exits_2_with_one_line(ranks: int, overrides: list[str], expected: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    gpt = [] if expected.startswith("splits") else ["model.name=gpt"]
    code = main(["train", "--nproc-per-node", str(ranks), *gpt, *overrides])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dtlab: error: ") and expected in lines[0], lines[0]
    assert "fix" in lines[0]


def test_pipeline_on_one_rank(runs: Path, session_dir: Path) -> None:
    """A pipeline on one rank (both stages local, no communication) runs the same function."""
    ref = step_losses(runs / "single")
    run = session_dir / "pp-one-rank"
    proc = ranks.train(1, *GPT_TINY, "strategy.name=pp", "strategy.pp.schedule=interleaved_1f1b",
                       f"run.dir={run}", "run.log_every=1", "run.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max_rel_dev(step_losses(run), ref) < TOL
    assert torch.isfinite(torch.tensor(step_losses(run))).all()


def test_sweeps_take_the_strategies_and_their_meshes(tmp_path: Path) -> None:
    from dtlab.sweeps.spec import SweepSpec, expand, load_spec

    for name, count in [("model_parallel", 9), ("pipeline_bubble", 12)]:
        plans = expand(load_spec(CONFIGS / "sweeps" / f"{name}.yaml"), tmp_path, "local")
        assert len(plans) == count and all(p.invalid is None for p in plans), name
    spec = SweepSpec(base=str(CONFIGS / "tp_gpt.yaml"), overrides={"strategy.tp.degree": 2},
                     matrix={"strategy.name": ["fsdp_tp"], "nproc_per_node": [2, 3, 4]})
    plans = {p.nproc_per_node: p for p in expand(spec, tmp_path, "local")}
    assert plans[2].invalid is None and plans[4].invalid is None
    assert "strategy.tp.degree=2 does not divide world_size=3" in str(plans[3].invalid)


def test_gpt_parts_compose_to_the_whole() -> None:
    """Pipeline stages are GPT parts: they share the GPT's parameters and keep their names."""
    torch.manual_seed(0)
    gpt = GPT(n_layer=3, n_head=2, n_embd=32, block_size=8, vocab_size=20).eval()
    first, last = gpt.part(["0", "1"], True, False), gpt.part(["2"], False, True)
    idx = torch.randint(0, 20, (2, 8))
    hidden = first(idx)
    assert hidden.shape == (2, 8, 32) and torch.equal(last(hidden), gpt(idx))
    assert first.h["0"].attn.q_proj.weight is gpt.h["0"].attn.q_proj.weight
    names = dict(first.named_parameters()).keys() | dict(last.named_parameters()).keys()
    assert names == dict(gpt.named_parameters()).keys()
    assert "lm_head.weight" not in dict(first.named_parameters())
