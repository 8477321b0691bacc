"""Honest numbers and the friction of a user's first hour (issue 26): an MFU that cannot be true is
withheld with the reason, samples/s and the step time are one statistic, options and overrides go
in any order, `sample` streams its text with its rate and a bound on --tokens, and a mesh shape
whose ranks differ from --nproc-per-node is said before anything starts."""

from __future__ import annotations

import argparse
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab

from dtlab.cli.compare import check_arguments, print_table
from dtlab.cli.main import build_parser
from dtlab.instruments import flops
from dtlab.instruments.machine_load import mfu_line
from dtlab.instruments.metrics import MetricsLog

TINY_GPT = ["model.name=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
            "model.block_size=16", "model.vocab_size=256"]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------------------ MFU
def test_an_mfu_above_100_percent_is_withheld_with_the_reason() -> None:
    """An MFU above 100% is withheld: summary.json's mfu is null and mfu_note says why and how to fix it."""
    got = flops.mfu(0.5, 0.25, "float32 matmul measured on this CPU before the first step with 2 "
                    "thread(s)", probed=True, unreliable=[])
    assert got == {"mfu": None, "mfu_note": (
        "withheld: the steps reached 0.5 TFLOP/s per rank, 200% of the peak of 0.25 TFLOP/s "
        "(float32 matmul measured on this CPU before the first step with 2 thread(s)), so that "
        "peak is wrong; fix: rerun on an idle machine, or set run.peak_tflops")}
    user_set = flops.mfu(3.0, 1.0, "run.peak_tflops", probed=False, unreliable=[])
    assert user_set["mfu"] is None
    assert user_set["mfu_note"].endswith("fix: set run.peak_tflops to the device's peak TFLOP/s")


def test_a_cpu_peak_measured_on_a_loaded_machine_gives_no_mfu() -> None:
    """A CPU peak probed while the run's timings were unreliable (machine loaded) gives no MFU; a datasheet peak still does."""
    loaded = ["machine loaded: other processes kept 1.5 of 2 core(s) busy"]
    got = flops.mfu(0.05, 0.2, "float32 matmul ...", probed=True, unreliable=loaded)
    assert got["mfu"] is None and got["mfu_note"] == (
        "withheld: the peak was measured on this CPU while its timings were unreliable (machine "
        "loaded: other processes kept 1.5 of 2 core(s) busy); fix: rerun on an idle machine, or "
        "set run.peak_tflops")
    assert flops.mfu(100.0, 989.4, "H100 datasheet, bf16 dense", probed=False,
                     unreliable=loaded) == {"mfu": pytest.approx(100 / 989.4),
                                            "mfu_note": "H100 datasheet, bf16 dense"}


def test_a_withheld_mfu_prints_n_a_and_why_in_the_summary_and_in_compare(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A withheld MFU reads n/a with its reason in the [METRIC] summary line, the line after it and compare's table; a real one names its peak."""
    note = "withheld: the steps reached 0.5 TFLOP/s per rank, 200% of the peak"
    summary = {"strategy": "single", "samples_per_s": 10.0, "tflops_per_rank": 0.5,
               "peak_tflops": 0.25, "mfu": None, "mfu_note": note}
    log = MetricsLog(tmp_path, True, 1, False)
    log.write_summary(summary)
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["[METRIC] summary=1 strategy=single samples_per_s=10 tflops_per_rank=0.5 "
                   "peak_tflops=0.25 mfu=n/a", f"MFU: n/a ({note})"]
    assert json.loads((tmp_path / "summary.json").read_text())["mfu"] is None
    fine = {**summary, "mfu": 0.231, "peak_tflops": 0.2, "mfu_note": "float32 matmul measured "
            "on this CPU before the first step with 2 thread(s)"}
    assert mfu_line(fine) == ("MFU: 23.1% of 0.2 TFLOP/s per rank (float32 matmul measured on "
                              "this CPU before the first step with 2 thread(s))")
    print_table([{"strategy": "single", "samples_per_s": 10.0, "mfu_pct": None}],
                {"single": summary})
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["single", "10.0", "n/a"]
    assert table[2:] == ["samples_per_s, step_time_ms, tflops_per_rank, mfu_pct: of the median "
                         "timed step", f"single: MFU: n/a ({note})"]


def test_a_run_withholds_an_mfu_above_100_percent_and_reports_samples_per_s_of_the_median_step(
        tmp_path: Path) -> None:
    """A run whose run.peak_tflops is below what its steps reach ends with `MFU: n/a (withheld: ...)`, and its samples/s is the global batch over the median step."""
    proc = dtlab("train", "--config", str(CONFIGS / "fsdp_gpt.yaml"), "strategy.name=single",
                 "model.n_layer=1", "train.max_steps=3", "run.timing_warmup_steps=1",
                 "run.peak_tflops=0.001", "train.checkpoint_every=0",
                 "data.synthetic.val_samples=32", "run.progress=false", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["tflops_per_rank"] > 0.001 and s["peak_tflops"] == 0.001 and s["mfu"] is None
    assert s["mfu_note"].startswith("withheld: the steps reached ") and \
        "(run.peak_tflops), so that peak is wrong" in s["mfu_note"]
    assert proc.stdout.splitlines()[-1] == f"MFU: n/a ({s['mfu_note']})"
    assert " mfu=n/a" in proc.stdout.splitlines()[-2]
    assert s["samples_per_s"] == pytest.approx(s["global_batch_size"] / s["median_step_time_s"])


@pytest.mark.parametrize("value", ["1e-9", "0", "-3", "1e30"])
def test_an_implausible_peak_tflops_is_refused(value: str, tmp_path: Path) -> None:
    """run.peak_tflops of 1e-9, 0, a negative value or 1e30 is refused in one line before anything runs."""
    proc = dtlab("train", f"run.peak_tflops={value}", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    shown = f"{float(value):g}"
    assert one_line(proc.stderr) == (
        f"dtlab: error: run.peak_tflops={shown} is no device's peak TFLOP/s per rank (0.001 to "
        "100000); fix: the datasheet's dense TFLOP/s for the run's precision, e.g. "
        "run.peak_tflops=989 (H100, bf16), or leave it unset")


# ------------------------------------------------------------------------------ argument order
@pytest.mark.parametrize("argv", [
    ["train", "train.lr=0.1", "--nproc-per-node", "2", "seed=3"],
    ["compare", "train.lr=0.1", "--strategies", "ddp", "seed=3", "--out", "x"],
    ["config", "train.lr=0.1", "--config", "f.yaml", "seed=3"],
    ["estimate", "train.lr=0.1", "--world-size", "4", "seed=3"],
])
def test_options_and_overrides_are_taken_in_any_order(argv: list[str]) -> None:
    """Options after KEY=VALUE overrides are taken (`dtlab train key=value --nproc-per-node 2`), for every command with overrides."""
    args = build_parser().parse_args(argv)
    assert args.overrides == ["train.lr=0.1", "seed=3"]
    assert args.nproc_per_node == 2 if argv[0] == "train" else True


def test_a_command_with_an_option_after_its_overrides_runs(tmp_path: Path) -> None:
    """`dtlab config KEY=VALUE --config FILE KEY=VALUE` prints the config with both overrides."""
    proc = dtlab("config", "train.max_steps=3", "--config", str(CONFIGS / "fsdp_gpt.yaml"),
                 "seed=7")
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 3" in proc.stdout and "seed: 7" in proc.stdout and "n_head: 4" in proc.stdout


def test_an_unknown_option_among_overrides_is_named_alone() -> None:
    """An unknown option among overrides is refused by name alone, with the command's own --help."""
    proc = dtlab("train", "seed=1", "--gpus", "2", "train.lr=0.1")
    assert proc.returncode == 2
    assert one_line(proc.stderr) == ("dtlab: error: unrecognized arguments: --gpus; fix: see "
                                     "`dtlab train --help`")


# ------------------------------------------------------------------------------ sample
@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of a tiny GPT (random weights) on `dtlab prepare`d bytes."""
    from safetensors.torch import save_file

    from dtlab.config import load_config, to_yaml
    from dtlab.data import spec_for
    from dtlab.models import build_model

    root = tmp_path_factory.mktemp("sample")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    assert dtlab("prepare", str(root / "a.txt"), "--out", str(root / "data")).returncode == 0
    cfg = load_config(None, [*TINY_GPT, "data.name=tokens", f"data.dir={root / 'data'}"])
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    save_file(build_model(cfg.model, spec_for(cfg), cfg.train.lora).state_dict(),
              str(run / "model.safetensors"))
    return run


class Recorder(io.StringIO):
    """stdout that notes, at each flush, how many tokens had been generated by then."""

    def __init__(self, drawn: list[int]) -> None:
        super().__init__()
        self.drawn, self.seen = drawn, []

    def flush(self) -> None:
        self.seen.append(len(self.drawn))
        super().flush()


def test_sample_streams_its_text_and_prints_its_rate(text_run: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`dtlab sample` writes its text as it is generated (not at the end) and ends with its rate on stderr."""
    from dtlab.text import sample as sampling

    drawn: list[int] = []
    generate = sampling.generate

    def counted(*args: object, **kwargs: object) -> Iterator[int]:
        for t in generate(*args, **kwargs):  # type: ignore[arg-type]
            drawn.append(t)
            yield t

    monkeypatch.setattr(sampling, "generate", counted)
    out = Recorder(drawn)
    made, seconds = sampling.sample(text_run, "the ", 12, 0.8, 50, 0, 1, out)  # the defaults
    assert made == len(drawn) == 12 and seconds > 0
    # text reached stdout while tokens were still being drawn, at several points
    assert len({n for n in out.seen if 0 < n < 12}) >= 2, out.seen
    assert out.getvalue().startswith("the ") and out.getvalue().endswith("\n")
    monkeypatch.undo()
    proc = dtlab("sample", str(text_run), "--prompt", "the ", "--tokens", "12")
    assert proc.returncode == 0 and proc.stdout == out.getvalue()  # the same text, streamed
    assert re.fullmatch(r"dtlab: 12 tokens in \d+\.\d s \(\d+\.\d tokens/s\)", one_line(proc.stderr))


def test_streamed_text_holds_back_a_character_split_over_tokens() -> None:
    """Streamed text never shows half a character: a letter split over byte tokens is written whole."""
    from dtlab.text.sample import text_pieces
    from dtlab.text.tokenizer import ByteTokenizer

    text = "héllo ✓ ok"
    pieces = list(text_pieces(ByteTokenizer(), ByteTokenizer().encode(text)))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) == len(text)  # one piece per character, as soon as it is complete


def test_sample_refuses_more_tokens_than_its_bound_and_notes_a_sliding_window(text_run: Path) -> None:
    """`dtlab sample --tokens 100000` is refused in one line naming the bound; past the context a note says the window slides."""
    proc = dtlab("sample", str(text_run), "--tokens", "100000")
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc.stderr) == (
        "dtlab: error: --tokens 100000 is more than 10 x the model's context of 16 tokens; fix: "
        "--tokens 160 or fewer (beyond its context the model sees only the last 16 tokens)")
    proc = dtlab("sample", str(text_run), "--prompt", "the ", "--tokens", "20")
    assert proc.returncode == 0 and proc.stderr.splitlines()[0] == (
        "dtlab: note: the prompt (4) and 20 new tokens outgrow the model's context of 16: each "
        "token is drawn from the last 16 (a sliding window)")


# ------------------------------------------------------------------------------ mesh ranks
def test_a_mesh_whose_ranks_differ_from_nproc_per_node_is_refused_before_any_run(
        tmp_path: Path) -> None:
    """`compare --strategies hsdp@3x2 --nproc-per-node 4` is refused in one line naming both numbers, before any run (nothing written)."""
    out = tmp_path / "out"
    proc = dtlab("compare", "--strategies", "hsdp@3x2", "--nproc-per-node", "4", "--out", str(out))
    assert proc.returncode == 2 and not out.exists() and proc.stdout == ""
    assert one_line(proc.stderr) == (
        "dtlab: error: --strategies hsdp@3x2 runs on 3x2 = 6 ranks, and --nproc-per-node is 4; "
        "fix: hsdp@2x2 for 4 ranks, or --nproc-per-node 6")
    proc = dtlab("estimate", "--config", str(CONFIGS / "fsdp_gpt.yaml"), "--world-size", "4",
                 "--strategies", "ddp,fsdp_tp@3x2")
    assert proc.returncode == 2 and one_line(proc.stderr) == (
        "dtlab: error: --strategies fsdp_tp@3x2 runs on 3x2 = 6 ranks, and --world-size is 4; "
        "fix: fsdp_tp@2x2 for 4 ranks, or --world-size 6")


def test_a_mesh_beside_strategies_on_nproc_per_node_is_noted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mesh of other ranks beside strategies that run on --nproc-per-node is said in one note before any run."""
    args = argparse.Namespace(strategies="single,ddp,hsdp@2x2", nproc_per_node=2, config=None,
                              out=str(tmp_path / "out"), verify=False, tolerance=None,
                              overrides=[])
    assert list(check_arguments(args)) == ["single", "ddp", "hsdp@2x2"]
    assert capsys.readouterr().err == ("dtlab: note: hsdp@2x2 on 4 ranks (a mesh sets its ranks); "
                                       "the other strategies on --nproc-per-node 2\n")
    args.nproc_per_node, args.strategies, args.tolerance = None, "ddp,hsdp@2x2", None
    check_arguments(args)  # --nproc-per-node not given: the default, quietly
    assert args.nproc_per_node == 2 and capsys.readouterr().err == ""
