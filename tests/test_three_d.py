"""3-D parallelism: pipeline x tensor x data parallel on one (pp, dp, tp) mesh, for dtlab's GPT
on 8 gloo ranks (strategies/pp_tp.py), against `single`.

One `dtlab compare --verify` runs single, single@pp2.tp2 (the 2-D part, on 4 ranks) and
fsdp@pp2.tp2 (8 ranks: 2 pipeline stages x 2 FSDP2 replicas x 2 tensor-parallel ranks), with
gradient clipping over every shard; an interleaved 1F1B schedule runs the same layout; a 3-D
checkpoint resumes under fsdp on 4 ranks and continues as single did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab, fast_launches, max_rel_dev, step_losses, train
from test_model_parallel import GPT_TINY, TOL

from dtlab.cli.compare import param_deviation, run_label

STEPS = 6
SETTINGS = [*(o for o in GPT_TINY if not o.startswith("train.max_steps")), f"train.max_steps={STEPS}",
            "train.optimizer=sgd", "train.weight_decay=0", "train.checkpoint_every=3"]
LAYOUTS = ["single@pp2.tp2", "fsdp@pp2.tp2"]


def verified(out: Path, layouts: list[str], nproc: int, steps: int, *settings: str) -> Path:
    """`dtlab compare --verify` of single and `layouts` on `nproc` ranks into `out`, passed."""
    with fast_launches():
        proc = dtlab("compare", "--strategies", ",".join(["single", *layouts]), "--nproc-per-node",
                     str(nproc), "--verify", "--tolerance", str(TOL), "--out", str(out), *settings)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"verify passed: {steps} steps vs single" in proc.stdout
    return out


@pytest.fixture(scope="module")
def runs(session_dir: Path) -> Path:
    return verified(session_dir / "three-d", LAYOUTS, 8, STEPS, *SETTINGS)


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_3d_losses_and_parameters_match_single(runs: Path, layout: str) -> None:
    ref = step_losses(runs / "single")
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.1  # it trained
    run = runs / run_label(layout)
    assert max_rel_dev(step_losses(run), ref) < TOL
    # the full state gathered from every stage, tensor-parallel shard and FSDP shard
    assert param_deviation(run / "model.safetensors", runs / "single" / "model.safetensors") < TOL


def test_3d_runs_on_one_mesh_and_splits_the_state(runs: Path) -> None:
    s = summary(runs / run_label("fsdp@pp2.tp2"))
    assert (s["layout"], s["world_size"]) == ("fsdp@pp2.tp2", 8)
    assert s["strategy_options"]["mesh"] == {"pp": 2, "dp": 2, "tp": 2}
    assert s["strategy_options"]["dp"] == "fsdp"
    assert summary(runs / run_label("single@pp2.tp2"))["layout"] == "single@pp2.tp2"
    whole = summary(runs / "single")["memory_per_rank"]["param_bytes"][0]
    held = s["memory_per_rank"]["param_bytes"]
    assert len(held) == 8 and max(held) < whole / 4  # each rank: a stage's tp and fsdp shard


def test_interleaved_1f1b_on_the_3d_mesh_matches_single(runs: Path, session_dir: Path) -> None:
    out = session_dir / "three-d-interleaved"
    s = train(out, *SETTINGS, "strategy.name=fsdp", "parallel.pp=2", "parallel.tp=2",
              "strategy.pp.schedule=interleaved_1f1b", "train.checkpoint_every=0", nproc=8)
    assert s["pipeline"]["stages"] == 4 and s["layout"] == "fsdp@pp2.tp2"
    assert max_rel_dev(step_losses(out), step_losses(runs / "single")) < TOL


def test_a_3d_checkpoint_resumes_under_fsdp_on_4_ranks(runs: Path, session_dir: Path) -> None:
    """Each rank wrote its stage's tensor-parallel and FSDP shards under the whole model's names
    (DCP); fsdp on 4 ranks reads them into its own shards and continues as single did."""
    ckpt = runs / run_label("fsdp@pp2.tp2") / "checkpoints" / "step_000003"
    out = session_dir / "three-d-resumed"
    s = train(out, *SETTINGS, "strategy.name=fsdp", f"resume={ckpt}", "run.save_model=true",
              nproc=4)
    assert s["resumed_from"]["step"] == 3
    assert max_rel_dev(step_losses(out), step_losses(runs / "single")[3:]) < TOL
    assert param_deviation(out / "model.safetensors", runs / "single" / "model.safetensors") < TOL


def test_ddp_over_3d_stages_is_refused_in_one_line(tmp_path: Path) -> None:
    proc = dtlab("train", "--nproc-per-node", "8", *SETTINGS, "strategy.name=ddp",
                 "parallel.pp=2", "parallel.tp=2", f"run.dir={tmp_path / 'run'}")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("dtlab: error: ddp over pipeline x tensor-parallel stages "
                           "(strategy.pp.dp=ddp with strategy.pp.tp=2) is not supported; fix: "
                           "fsdp@pp2.tp2 (strategy.pp.dp=fsdp)\n")


def test_estimate_gives_the_3d_runs_bytes_per_rank(runs: Path) -> None:
    """Measured under the fake backend with the real wrappers: every rank's parameter, gradient
    and optimizer bytes as the 8-rank run reported them."""
    proc = dtlab("estimate", "--json", "--world-size", "8", "--strategies", "fsdp@pp2.tp2",
                 *SETTINGS, "strategy.name=fsdp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)["rows"]
    estimated = [[r[k] for r in row["per_rank"]] for k in ("param_bytes", "grad_bytes", "optim_bytes")]
    measured = summary(runs / run_label("fsdp@pp2.tp2"))["memory_per_rank"]
    assert estimated == [measured[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")]
    assert row["exact"] and row["source"] == "measured (fake backend)"


@pytest.mark.parametrize(("schedule", "nproc", "tp"), [("zbv", 4, 2), ("interleaved_zb", 2, 1)])
def test_zero_bubble_schedules_match_single(runs: Path, session_dir: Path, schedule: str,
                                            nproc: int, tp: int) -> None:
    """The backward split into input and weight gradients, the weights' part filling the bubble:
    one pipeline of 2 ranks (x 2 tensor-parallel ranks for ZBV), 4 stages, as single trained.
    (DualPipeV, the other V-shaped schedule, matched too: docs/model_parallel.md.)"""
    out = session_dir / f"zero-bubble-{schedule}"
    s = train(out, *SETTINGS, "strategy.name=single", "parallel.pp=2", f"parallel.tp={tp}",
              f"strategy.pp.schedule={schedule}", "train.checkpoint_every=0", nproc=nproc)
    pipeline = s["pipeline"]
    assert (pipeline["schedule"], pipeline["stages"], pipeline["bubble_theory"]) == (schedule, 4, None)
    assert 0 <= pipeline["bubble_measured"] < 1
    assert max_rel_dev(step_losses(out), step_losses(runs / "single")) < TOL


def test_zero_bubble_with_data_parallel_replicas_is_refused(tmp_path: Path) -> None:
    from test_bad_inputs import refused

    line = refused(["train", "--nproc-per-node", "4", *SETTINGS, "strategy.name=fsdp",
                    "parallel.pp=2", "strategy.pp.schedule=zbv", "run.dir=r"], tmp_path)
    assert line == (
        "dtlab: error: strategy.pp.schedule=zbv splits each backward into its input and weight "
        "gradients, and the 2 data-parallel replicas' gradients are not reduced right under that "
        "split (FSDP replicas drift from one process); fix: one pipeline, single@pp2 on 2 ranks, "
        "or schedule=interleaved_1f1b|1f1b with replicas"), line


LLAMA = [f"--config={CONFIGS / 'hf_llama.yaml'}"]
LLAMA_SETTINGS = ["model.hf.config.num_hidden_layers=4", "train.max_steps=3",
                  "train.optimizer=sgd", "train.lr=0.1", "train.weight_decay=0",
                  "train.checkpoint_every=0"]


def test_a_tiny_llama_on_the_3d_mesh_matches_single(session_dir: Path) -> None:
    """A transformers Llama (a LlamaConfig, 4 decoder layers) split into pipeline stages under
    its own names, each stage tensor-parallel with the Llama plan, FSDP2 over the replicas:
    fsdp@pp2.tp2 on 8 ranks with 1F1B, and the 2-D single@pp2.tp2 with interleaved 1F1B on 4."""
    out = verified(session_dir / "three-d-llama", ["fsdp@pp2.tp2"], 8, 3, *LLAMA,
                   *LLAMA_SETTINGS)
    s = summary(out / run_label("fsdp@pp2.tp2"))
    assert (s["layout"], s["strategy_options"]["mesh"]) == ("fsdp@pp2.tp2", {"pp": 2, "dp": 2, "tp": 2})
    interleaved = session_dir / "three-d-llama-interleaved"
    s = train(interleaved, *LLAMA_SETTINGS, "strategy.name=single", "parallel.pp=2",
              "parallel.tp=2", "strategy.pp.schedule=interleaved_1f1b", nproc=4,
              config=str(CONFIGS / "hf_llama.yaml"))
    assert s["pipeline"]["stages"] == 4
    assert max_rel_dev(step_losses(interleaved), step_losses(out / "single")) < TOL
