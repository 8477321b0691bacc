"""Layouts as the data-parallel flavour over model-parallel degrees (dtlab/config/layout.py):
`strategy.name` + `parallel.pp/tp/cp`, and `FLAVOUR@DIMn...` in --strategies, resolve to the same
configs as today's shorthands (tp, fsdp_tp, pp and their keys); a combination dtlab does not
run is one line, exit 2, before any rank starts. (The runs of these layouts: test_model_parallel.py
and test_three_d.py, which check the layout each run reports.)"""

from __future__ import annotations

import pytest
from conftest import CONFIGS, dtlab

from dtlab.config import load_config
from dtlab.config.layout import layout_of
from dtlab.config.strategies import registry
from dtlab.config.strategies.layout_syntax import Layout
from dtlab.errors import ConfigError

GPT = str(CONFIGS / "tp_gpt.yaml")


@pytest.mark.parametrize(("text", "overrides"), [
    ("fsdp@pp2.tp2", ["strategy.name=fsdp", "parallel.pp=2", "parallel.tp=2"]),
    ("single@tp4", ["strategy.name=single", "parallel.tp=4"]),
    ("hsdp@tp8.pp8", ["strategy.name=hsdp", "parallel.tp=8", "parallel.pp=8"]),
    ("fsdp@cp2", ["strategy.name=fsdp", "parallel.cp=2"]),
    ("fsdp_tp@2x2", ["strategy.name=fsdp_tp", "strategy.tp.degree=2"]),  # the shorthand's own
])
def test_strategies_items_select_layouts(text: str, overrides: list[str]) -> None:
    assert registry.parse(text) == overrides


@pytest.mark.parametrize(("text", "error"), [
    ("fsdp@tpx", "--strategies: 'fsdp@tpx' has a bad dimension 'tpx'; fix: fsdp@ then pp, tp, "
                 "cp each followed by its degree, joined by dots, e.g. fsdp@pp2.tp2"),
    ("fsdp@tp0", "--strategies: 'fsdp@tp0' has a bad dimension 'tp0'; fix: fsdp@ then pp, tp, "
                 "cp each followed by its degree, joined by dots, e.g. fsdp@pp2.tp2"),
    ("ddp@tp2.tp2", "--strategies: 'ddp@tp2.tp2' gives tp twice; fix: give each dimension once"),
])
def test_bad_layout_items_are_one_line(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        registry.parse(text)
    assert str(e.value) == error


# The same layout written both ways: the config it loads to, and the layout it reports.
SAME = [
    ("single@tp2", ["strategy.name=tp", "strategy.tp.degree=2"], 2, "single@tp2"),
    ("fsdp@tp2", ["strategy.name=fsdp_tp", "strategy.tp.degree=2"], 4, "fsdp@tp2"),
    ("fsdp@pp2", ["strategy.name=pp", "strategy.pp.degree=2"], 4, "fsdp@pp2"),
    ("ddp@pp2", ["strategy.name=pp", "strategy.pp.degree=2", "strategy.pp.dp=ddp"], 4, "ddp@pp2"),
    ("single@pp2", ["strategy.name=pp", "strategy.pp.degree=2", "strategy.pp.dp=none"], 2,
     "single@pp2"),
    ("fsdp@pp2.tp2", ["strategy.name=pp", "strategy.pp.degree=2", "strategy.pp.tp=2"], 8,
     "fsdp@pp2.tp2"),
    ("single@pp2.tp2", ["strategy.name=pp", "strategy.pp.degree=2", "strategy.pp.tp=2",
                        "strategy.pp.dp=none"], 4, "single@pp2.tp2"),
]


@pytest.mark.parametrize(("text", "shorthand", "world", "reported"), SAME)
def test_a_layout_and_its_shorthand_are_one_config(text: str, shorthand: list[str], world: int,
                                                   reported: str) -> None:
    cfg = load_config(GPT, registry.parse(text))
    assert cfg.model_dump() == load_config(GPT, shorthand).model_dump()
    assert layout_of(cfg, world).text() == reported


def test_layout_of_counts_the_data_parallel_ranks() -> None:
    assert layout_of(load_config(GPT, ["strategy.name=fsdp_tp", "strategy.tp.degree=2"]), 8) == \
        Layout("fsdp", tp=2, dp=4)
    assert layout_of(load_config(GPT, ["strategy.name=pp", "strategy.pp.degree=2"]), 2) == \
        Layout("single", pp=2, dp=1)  # one pipeline: no replicas to synchronise
    assert layout_of(load_config(GPT, ["strategy.name=zero1"]), 4) == Layout("zero1", dp=4)
    assert Layout("fsdp", pp=2, tp=2, cp=2).text() == "fsdp@pp2.tp2.cp2"


REFUSED = [
    (["strategy.name=zero1", "parallel.pp=2", "parallel.tp=2"],
     "the layout zero1@pp2.tp2 (strategy.name=zero1 with parallel.pp=2 parallel.tp=2) puts zero1 "
     "over pipeline x tensor-parallel groups, which dtlab runs with ddp, fsdp or single only; "
     "fix: fsdp@pp2.tp2"),
    (["strategy.name=ddp", "parallel.cp=2"],
     "the layout ddp@cp2 (strategy.name=ddp with parallel.cp=2) puts ddp over context-parallel "
     "groups, which dtlab runs with fsdp or single only; fix: fsdp@cp2"),
    (["strategy.name=fsdp", "parallel.pp=2", "parallel.cp=2"],
     "the layout fsdp@pp2.cp2 (strategy.name=fsdp with parallel.pp=2 parallel.cp=2) composes "
     "pipeline x context parallelism, which dtlab does not run; fix: fsdp@pp2"),
    (["strategy.name=fsdp", "parallel.cp=2", "model.dropout=0.1"],
     "model.dropout=0.1 with context parallelism is not supported (the ring runs the attention "
     "kernel without dropout); fix: model.dropout=0"),
    (["strategy.name=single", "parallel.cp=3"],
     "strategy.cp.degree=3 does not divide world_size=4 into a mesh; fix: set strategy.cp.degree "
     "to a divisor of 4 (0 = every rank)"),
    (["strategy.name=ddp", "parallel.tp=2"],
     "the layout ddp@tp2 (strategy.name=ddp with parallel.tp=2) puts ddp over tensor-parallel "
     "groups, which dtlab runs with fsdp or single only; fix: fsdp@tp2"),
    (["strategy.name=zero1", "parallel.pp=4"],
     "the layout zero1@pp4 (strategy.name=zero1 with parallel.pp=4) puts zero1 over "
     "pipeline-parallel groups, which dtlab runs with ddp, fsdp or single only; fix: fsdp@pp4"),
    (["strategy.name=tp", "parallel.tp=2"],
     "strategy.name=tp is itself a model-parallel layout; fix: name the data-parallel flavour "
     "with parallel.* degrees (strategy.name=fsdp parallel.tp=2), or the shorthand alone "
     "(strategy.tp.degree, strategy.pp.degree)"),
    (["strategy.name=fsdp", "parallel.tp=2", "strategy.tp.degree=4"],
     "parallel.tp=2 and strategy.tp.degree=4 disagree; fix: give the layout once, as "
     "strategy.name and parallel.*"),
    (["strategy.name=single", "parallel.pp=2", "strategy.pp.dp=fsdp"],
     "strategy.name=single and strategy.pp.dp=fsdp disagree; fix: give the layout once, as "
     "strategy.name and parallel.*"),
    (["strategy.name=fsdp", "parallel.tp=0"],
     "parallel.tp: Input should be greater than 0 (got 0); fix: set parallel.tp to a valid value "
     "in the file or as parallel.tp=..."),
]


@pytest.mark.parametrize(("overrides", "error"), REFUSED)
def test_a_layout_dtlab_does_not_run_is_refused_before_any_rank(
        overrides: list[str], error: str, tmp_path) -> None:
    proc = dtlab("train", "--nproc-per-node", "4", "--config", GPT, *overrides,
                 f"run.dir={tmp_path / 'run'}")
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"dtlab: error: {error}\n")
    assert not (tmp_path / "run").exists()


def test_a_layout_without_data_parallelism_needs_its_ranks(tmp_path) -> None:
    proc = dtlab("train", "--nproc-per-node", "4", "--config", GPT, "strategy.name=single",
                 "parallel.pp=2", f"run.dir={tmp_path / 'run'}")
    assert (proc.returncode, proc.stderr) == (2, (
        "dtlab: error: single@pp2 (strategy.pp.dp=none) runs on exactly 2 ranks, not 4; fix: "
        "--nproc-per-node 2, or fsdp@pp2 (ddp@pp2) for data parallelism over the other ranks\n"))
    proc = dtlab("compare", "--strategies", "single,single@tp2", "--nproc-per-node", "4",
                 "--config", GPT, "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and proc.stderr.endswith(
        "--strategies single@tp2 runs on 2 ranks (no data parallelism: single), and "
        "--nproc-per-node is 4; fix: --nproc-per-node 2, or fsdp@tp2 for data parallelism over "
        "the other ranks\n"), proc.stderr
