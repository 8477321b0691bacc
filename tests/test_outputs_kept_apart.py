"""The outside audits' remaining findings: outputs that would sit among, or pass for, another output's
are refused in one line with the user's files left byte for byte (a run in a folder holding
another run, a results table, report, figures or export written into another run's or sweep's
directory, one run counted twice by collect, a config.yaml link replaced by a file); true/false
given for a number is refused instead of read as 1/0; a resume over the same token files no
longer described by meta.json is not reported as changed data."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab
from test_bad_inputs import refused

QUICK = ["train.max_steps=2", "run.progress=false", "run.save_model=false",
         "train.checkpoint_every=2"]


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/a and runs/b: two finished 2-step runs, each with a checkpoint at step 2."""
    work = tmp_path_factory.mktemp("two_runs")
    for name in ("a", "b"):
        ok(dtlab("train", *QUICK, f"run.dir=runs/{name}", cwd=work))
    return work


@pytest.fixture
def work(two_runs: Path, tmp_path: Path) -> Path:
    shutil.copytree(two_runs, tmp_path / "w", symlinks=True)
    return tmp_path / "w"


def test_a_run_in_a_folder_holding_another_run_is_refused(work: Path) -> None:
    """Its files would sit among the other's, and `collect runs` would count them together."""
    line = refused(["train", *QUICK, "run.dir=runs"], work)
    assert line == (f"dtlab: error: run.dir 'runs' holds a run in '{Path('runs/a')}', which this "
                    "run's files would sit among and be collected and reported with; fix: a "
                    "run.dir of its own beside it"), line
    assert refused(["train", *QUICK, "run.dir=."], work).startswith(
        "dtlab: error: run.dir '.' holds a run in 'runs/a'")


@pytest.mark.parametrize("args", [
    ["collect", "runs/a", "-o", "runs/b/results.csv"],
    ["report", "runs/a", "-o", "runs/b/report.html"],
    ["export", "runs/a/checkpoints/step_000002", "-o", "runs/b/model.safetensors"],
    ["export", "runs/a/checkpoints/step_000002", "-o", "runs/b/weights.safetensors"],
], ids=["collect", "report", "export", "export-other-name"])
def test_an_output_written_into_another_runs_directory_is_refused(work: Path,
                                                                  args: list[str]) -> None:
    out = args[-1]
    line = refused(args, work)
    assert line == (f"dtlab: error: -o/--output '{out}' is inside the run directory "
                    f"'{work / 'runs/b'}', and what is written there would pass for that "
                    "output's own; fix: a path outside it"), line


def test_an_output_made_from_that_directory_is_written_there(work: Path) -> None:
    ok(dtlab("collect", "runs/a", "-o", "runs/a/results.csv", cwd=work))
    ok(dtlab("report", "runs/a", "-o", "runs/a/mine.html", cwd=work))
    ok(dtlab("export", "runs/a/checkpoints/step_000002", "-o", "runs/a/w.safetensors", cwd=work))


def test_collect_counts_a_run_once_whatever_reaches_it_twice(work: Path) -> None:
    line = refused(["collect", "runs", "runs/a", "-o", "all.csv"], work)
    assert line == ("dtlab: error: 'runs/a' holds only runs that an earlier DIR holds, which would "
                    "count them twice; fix: pass each directory once"), line
    refused(["collect", "runs/a", "runs/a", "-o", "all.csv"], work)
    ok(dtlab("collect", "runs/a", "runs", "-o", "all.csv", cwd=work))
    assert len((work / "all.csv").read_text().splitlines()) == 1 + 2  # header, a, b


def test_a_config_yaml_link_in_run_dir_is_refused_and_kept(work: Path) -> None:
    (work / "mine.yaml").write_text("train: {lr: 0.05}\n")
    (work / "r").mkdir()
    os.symlink("../mine.yaml", work / "r/config.yaml")
    line = refused(["train", "--config", "r/config.yaml", *QUICK, "run.dir=r"], work)
    assert line == ("dtlab: error: run.dir 'r' holds config.yaml as a link to '../mine.yaml', "
                    "which the run would replace with a file of its resolved config; fix: remove "
                    "the link (--config can name the file itself), or choose another run.dir")
    assert os.readlink(work / "r/config.yaml") == "../mine.yaml"


@pytest.mark.parametrize(("key", "value", "kind"), [
    ("train.max_steps", "true", "integer"), ("train.lr", "false", "number"),
    ("data.synthetic.num_classes", "true", "integer")])
def test_true_or_false_for_a_number_is_refused(tmp_path: Path, key: str, value: str,
                                               kind: str) -> None:
    line = refused(["train", f"{key}={value}", "run.dir=r"], tmp_path)
    assert line.startswith(f"dtlab: error: {key}: Input should be a valid {kind} (got '{value}')")


def test_the_same_token_files_without_meta_json_are_not_changed_data(tmp_path: Path) -> None:
    from dtlab.files import file_sha256
    from dtlab.run.data_identity import data_changes, data_identity

    (tmp_path / "train.bin").write_bytes(b"\x01\x00" * 64)
    (tmp_path / "val.bin").write_bytes(b"\x02\x00" * 16)
    meta = {"files": {n: {"bytes": (tmp_path / n).stat().st_size,
                          "sha256": file_sha256(tmp_path / n)} for n in ("train.bin", "val.bin")}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    config = {"data": {"name": "tokens", "dir": str(tmp_path)}}
    saved = data_identity(config)
    (tmp_path / "meta.json").unlink()
    assert data_changes(saved, data_identity(config), tmp_path) == ""
    (tmp_path / "train.bin").write_bytes(b"\x03\x00" * 64)  # the same size, other tokens
    assert data_changes(saved, data_identity(config), tmp_path) == "train.bin (sha256)"
    (tmp_path / "val.bin").write_bytes(b"\x02\x00" * 17)
    assert data_changes(saved, data_identity(config), tmp_path) == \
        "train.bin (sha256), val.bin (sha256)"


@pytest.mark.parametrize("command", [
    ["compare", "--strategies", "single", "--nproc-per-node", "1", *QUICK[:2], "--out", "runs"],
    ["sweep", "s.yaml", "--out", "runs"]], ids=["compare", "sweep"])
def test_a_compare_or_sweep_out_holding_another_output_is_refused(work: Path,
                                                                  command: list[str]) -> None:
    """Its results (compare.csv, a sweep's results.csv and report) and `collect` would count
    the other runs in with its own."""
    (work / "s.yaml").write_text(f"base: {CONFIGS / 'quick.yaml'}\nmatrix: {{seed: [1]}}\n")
    line = refused(command, work)
    assert line == (f"dtlab: error: --out 'runs' holds a run in '{Path('runs/a')}', which this "
                    "command's results would count in; fix: a directory of its own beside it"), line


def test_a_run_dir_through_a_link_into_another_run_is_refused(work: Path) -> None:
    (work / "runs/a/sub").mkdir()
    os.symlink("runs/a/sub", work / "lk")
    line = refused(["train", *QUICK, "run.dir=lk"], work)
    assert line == (f"dtlab: error: run.dir 'lk' is inside the run directory '{work / 'runs/a'}', "
                    "whose files that run may replace or delete; fix: a run.dir outside it"), line


def test_prepare_refuses_token_files_it_did_not_write(tmp_path: Path) -> None:
    """nanoGPT's prepare.py writes train.bin and val.bin without meta.json: dtlab trains on
    them (data.dir), and `dtlab prepare --out` there would replace them."""
    import numpy as np

    (tmp_path / "d").mkdir()
    np.arange(2000, dtype=np.uint16).tofile(tmp_path / "d/train.bin")
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    line = refused(["prepare", "a.txt", "--out", "d"], tmp_path)
    assert line == (f"dtlab: error: --out 'd' holds train.bin, which no meta.json of dtlab prepare "
                    "describes (token files made elsewhere), and preparing replaces the whole "
                    f"directory; fix: choose another --out, e.g. {Path('d/tokens')}, or move them "
                    "out of it"), line
    (tmp_path / "d/train.bin").unlink()
    (tmp_path / "d/meta.json").write_text('{"mine": 1}')  # the user's own, not prepare's
    line = refused(["prepare", "a.txt", "--out", "d"], tmp_path)
    assert line == ("dtlab: error: --out 'd' holds meta.json, which dtlab prepare did not write, "
                    "and preparing replaces the whole directory; fix: choose another --out, e.g. "
                    f"{Path('d/tokens')}, or move them out of it"), line


def test_token_files_without_meta_json_are_hashed(tmp_path: Path) -> None:
    """Rewritten with other tokens of the same length, they are other data to a resume."""
    from dtlab.run.data_identity import data_changes, data_identity

    (tmp_path / "train.bin").write_bytes(b"\x01\x00" * 64)
    (tmp_path / "val.bin").write_bytes(b"\x02\x00" * 16)
    config = {"data": {"name": "tokens", "dir": str(tmp_path)}}
    saved = data_identity(config)
    assert set(saved["train.bin"]) == {"bytes", "sha256"}
    assert data_changes(saved, data_identity(config), tmp_path) == ""
    (tmp_path / "train.bin").write_bytes(b"\x05\x00" * 64)
    assert data_changes(saved, data_identity(config), tmp_path) == "train.bin (sha256)"


def test_lines_that_name_the_right_fix(work: Path) -> None:
    """-o - is no standard output; a sweep's refusal names --out; a damaged checkpoint's export
    says what to do."""
    assert refused(["collect", "runs", "-o", "-"], work) == (
        "dtlab: error: -o/--output '-': dtlab writes a file, not standard output; fix: name the "
        "file, e.g. --output results.csv")
    (work / "u").mkdir()
    (work / "u/results.csv").write_text("mine\n")
    (work / "s.yaml").write_text(f"base: {CONFIGS / 'quick.yaml'}\nmatrix: {{seed: [1]}}\n")
    assert refused(["sweep", "s.yaml", "--out", "u"], work).endswith(
        "fix: give this spec its own --out DIR, or move that file away first")
    ckpt = work / "runs/a/checkpoints/step_000002"
    (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:100])
    assert refused(["export", str(ckpt), "-o", "m.safetensors"], work).endswith(
        "it is truncated or was modified; fix: export another checkpoint of the run (its "
        "checkpoints/step_NNNNNN), or restore a good copy of this one")


def test_a_compare_clears_every_earlier_run_before_its_first(tmp_path: Path) -> None:
    """A compare cut short (here its ddp run killed) leaves none of the earlier compare's runs
    beside its own: collect and report would read them as one comparison."""
    compare = ["compare", "--strategies", "single,ddp", "--nproc-per-node", "2",
               "train.max_steps=2", "run.progress=false", "--out", "c"]
    ok(dtlab(*compare, cwd=tmp_path))
    failed = dtlab(*compare, "train.lr=0.3", "run.fault.kind=kill", "run.fault.step=1",
                   "run.fault.rank=1", cwd=tmp_path)
    assert failed.returncode != 0
    assert not list((tmp_path / "c").rglob("summary.json"))  # the earlier runs' are gone
    assert not (tmp_path / "c/compare.csv").exists()


def test_an_export_into_a_hugging_face_export_is_refused(work: Path) -> None:
    ckpt = "runs/a/checkpoints/step_000002"
    gpt = ["model.name=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
           "model.block_size=16", "model.vocab_size=64"]
    ok(dtlab("train", *QUICK, *gpt, "run.dir=g", cwd=work))
    ok(dtlab("export", "g/checkpoints/step_000002", "--format", "hf", "-o", "hf", cwd=work))
    line = refused(["export", ckpt, "-o", "hf/model.safetensors", "--overwrite"], work)
    assert line == ("dtlab: error: -o/--output 'hf/model.safetensors' is inside the Hugging Face "
                    "export 'hf', whose config and weights would no longer match; fix: export "
                    "--format hf -o hf to replace that export, or another -o"), line


def test_a_report_of_a_folder_of_several_sweeps_is_refused(tmp_path: Path) -> None:
    for name in ("s1", "s2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".dtlab-owner.json").write_text(
            json.dumps({"kind": "sweep", "owner": name, "entries": []}))
    line = refused(["report", "."], tmp_path)
    assert line == ("dtlab: error: '.' holds the outputs of 2 commands (sweep 's1', sweep 's2'), "
                    "whose runs one report would draw as one series; fix: report each of them, or "
                    "collect them with their source column (dtlab collect . -o all.csv)"), line


def test_a_users_files_in_checkpoints_are_refused_before_pruning(work: Path) -> None:
    """Pruning (keep_checkpoints) and starting over delete whole checkpoint folders."""
    (work / "runs/a/checkpoints/NOTES.txt").write_text("mine")
    (work / "runs/a/checkpoints/step_000002/my_eval.json").write_text("{}")
    for extra in ([], ["run.overwrite=true", "resume=none"]):
        line = refused(["train", *QUICK, "train.max_steps=4", "run.dir=runs/a", *extra], work)
        assert line == ("dtlab: error: run.dir 'runs/a' holds checkpoints/NOTES.txt, "
                        "checkpoints/step_000002/my_eval.json, which dtlab did not write and prunes "
                        "or replaces with its checkpoints; fix: move them out of checkpoints/"), line


def test_a_resume_removes_the_runs_weights_and_refuses_beside_its_report(work: Path) -> None:
    """The weights of step 2 would stand beside step 4's checkpoints and summary: removed, and
    said; the report of step 2 is report's: refused, not removed."""
    ok(dtlab("train", *QUICK[:1], "run.progress=false", "train.checkpoint_every=2",
             "run.save_model=true", "run.dir=w", cwd=work))
    ok(dtlab("report", "w", cwd=work))
    assert (work / "w/model.safetensors").is_file() and (work / "w/report.html").is_file()
    resume = ["train", "train.max_steps=4", "run.progress=false", "train.checkpoint_every=2",
              "run.save_model=false", "run.dir=w"]
    line = refused(resume, work)
    assert line == ("dtlab: error: run.dir 'w' holds report.html, which `dtlab report` made of the "
                    "run so far and which would describe it wrongly once it goes on; fix: move it "
                    "away (dtlab report w makes a new one), or choose another run.dir"), line
    (work / "w/report.html").rename(work / "report-step2.html")
    resumed = dtlab(*resume, cwd=work)
    ok(resumed)
    assert not (work / "w/model.safetensors").exists()
    assert ("dtlab: removed the earlier run's model.safetensors from run.dir 'w' (the weights "
            "of its earlier end)") in resumed.stderr.splitlines(), resumed.stderr


def test_a_compare_refuses_a_config_inside_its_out(tmp_path: Path) -> None:
    (tmp_path / "c/single").mkdir(parents=True)
    (tmp_path / "c/single/config.yaml").write_text("train: {max_steps: 2}\n")
    line = refused(["compare", "--config", "c/single/config.yaml", "--strategies", "single",
                    "--out", "c"], tmp_path)
    assert line == ("dtlab: error: --config 'c/single/config.yaml' is inside --out 'c', whose runs "
                    "this compare replaces before it reads them; fix: copy it out first (e.g. cp "
                    "c/single/config.yaml base.yaml) and pass that"), line


def test_collect_of_several_dirs_names_each_rows_dir(work: Path) -> None:
    import csv

    ok(dtlab("collect", "runs/a", "runs/b", "-o", "two.csv", cwd=work))
    rows = list(csv.DictReader((work / "two.csv").read_text().splitlines()))
    assert sorted(r["source"] for r in rows) == ["runs/a", "runs/b"]


def test_a_runs_config_yaml_does_not_carry_overwrite(work: Path) -> None:
    """run.overwrite=true deletes what is there once; a later `--config RUN/config.yaml` must
    ask again."""
    ok(dtlab("train", *QUICK, "run.dir=runs/a", "run.overwrite=true", "resume=none", cwd=work))
    assert "overwrite: false" in (work / "runs/a/config.yaml").read_text()
    line = refused(["train", "--config", "runs/a/config.yaml", "train.lr=0.1", "resume=none"], work)
    assert line.startswith("dtlab: error: run.dir 'runs/a' holds an earlier run"), line


def test_prepare_refuses_one_file_twice_and_an_out_inside_a_run(work: Path) -> None:
    (work / "corp").mkdir()
    (work / "corp/a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    line = refused(["prepare", "corp", "corp/a.txt", "--out", "d"], work)
    assert line == (f"dtlab: error: {Path('corp/a.txt')} is the same file as "
                    f"{Path('corp/a.txt')}, given twice (by name, inside a directory, or through a "
                    "link); fix: pass each file once"), line
    line = refused(["prepare", "corp", "--out", "runs/a/checkpoints"], work)
    assert line.startswith("dtlab: error: --out 'runs/a/checkpoints' is inside the output of "
                           "dtlab run"), line


def test_a_compare_again_refuses_its_earlier_report_and_the_users_files_and_keeps_its_runs(
        tmp_path: Path) -> None:
    """The report of the earlier runs would describe runs that are gone: a compare again is
    refused until it is moved away (deleting it unasked would lose what the user asked for); a
    user's file in a run's checkpoints/ is refused (the run is replaced whole); a `dtlab train`
    into one of its runs, while no compare runs there, is refused (its table describes it)."""
    compare = ["compare", "--strategies", "single", "--nproc-per-node", "1", *QUICK[:3],
               "train.checkpoint_every=2", "--out", "c"]
    ok(dtlab(*compare, cwd=tmp_path))
    ok(dtlab("report", "c", cwd=tmp_path))
    assert {"report.html", "results.csv", "plots"} <= {p.name for p in (tmp_path / "c").iterdir()}
    (tmp_path / "c/notes.txt").write_text("mine")
    (tmp_path / "c/plots/my_annotations.md").write_text("mine")
    (tmp_path / "c/single/checkpoints/NOTE.txt").write_text("mine")
    line = refused(compare, tmp_path)
    assert line == ("dtlab: error: --out 'c' holds single/checkpoints/NOTE.txt, which dtlab did "
                    "not write and this compare would delete with the run it replaces; fix: move "
                    "it out of the run's checkpoints/, or --out a new directory"), line
    (tmp_path / "c/single/checkpoints/NOTE.txt").unlink()
    line = refused([*compare, "train.lr=0.03"], tmp_path)
    assert line == ("dtlab: error: --out 'c' holds report.html, results.csv, plots/, which `dtlab "
                    "report` made of the earlier compare's runs and which this compare would leave "
                    "describing runs that are gone; fix: move them away, or --out a new "
                    "directory"), line
    for name in ("report.html", "results.csv"):
        (tmp_path / "c" / name).unlink()
    shutil.rmtree(tmp_path / "c/plots")
    said = ok(dtlab(*compare, "train.lr=0.03", cwd=tmp_path))
    assert said.splitlines()[0] == ("dtlab compare: replacing the earlier compare's single in "
                                    "'c' (--out a new directory keeps them)"), said
    assert (tmp_path / "c/notes.txt").read_text() == "mine"
    line = refused(["train", *QUICK, "train.lr=0.3", "run.dir=c/single", "run.overwrite=true"],
                   tmp_path)
    assert line == (f"dtlab: error: run.dir 'c/single' is a run of dtlab compare '{tmp_path / 'c'}'"
                    ", whose table describes it; fix: run that compare again to retrain it, or a "
                    "run.dir outside it"), line


def test_a_resume_for_more_steps_says_the_schedule_changed(work: Path) -> None:
    proc = dtlab("train", "train.max_steps=4", "run.progress=false", "train.checkpoint_every=2",
                 "run.dir=runs/a", cwd=work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("dtlab: warning: the cosine learning-rate schedule now spans 4 steps, not the 2 the "
            "checkpoint was trained for: from step 3 the learning rate is a 4-step run's, not "
            "where the earlier run was heading") in proc.stderr


def test_a_run_into_a_token_data_set_is_refused(tmp_path: Path) -> None:
    """prepare replaces its folder whole: a run's files there would go with it (and stand among
    the token files)."""
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    ok(dtlab("prepare", "corpus.txt", "--out", "data", cwd=tmp_path))
    line = refused(["train", *QUICK, "run.dir=data"], tmp_path)
    assert line == ("dtlab: error: run.dir 'data' is a token data set (train.bin, val.bin), whose "
                    "folder dtlab prepare replaces whole and whose files the run's would sit "
                    "among; fix: a run.dir of its own (e.g. runs/NAME), with data.dir naming "
                    "that folder"), line


def test_collect_tells_apart_runs_of_one_strategy_by_the_keys_they_differ_in(work: Path) -> None:
    """Two `single` runs with another learning rate: one series each, not one line of both; two
    alike runs keep the strategy's name alone."""
    ok(dtlab("train", *QUICK, "train.lr=0.3", "run.dir=runs/c", cwd=work))
    ok(dtlab("collect", "runs/a", "runs/c", "-o", "all.csv", cwd=work))
    series = sorted(r["series"] for r in csv.DictReader((work / "all.csv").open()))
    assert series == ["single, train.lr=0.05", "single, train.lr=0.3"], series
    ok(dtlab("collect", "runs/a", "runs/b", "-o", "alike.csv", cwd=work))
    assert [r["series"] for r in csv.DictReader((work / "alike.csv").open())] == ["single"] * 2


def test_a_plot_stopped_half_way_leaves_the_earlier_plot_whole(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The figures are drawn aside and swapped in: Ctrl-C while drawing changes nothing."""
    from dtlab.results import plot

    rows = [{"series": s, "strategy": s, "world_size": n, "status": "done",
             "samples_per_s": 100.0 * n * (1 if s == "ddp" else 0.8), "peak_memory_bytes": 2**20}
            for s in ("ddp", "fsdp") for n in (1, 2)]
    first = plot.plot_results(rows, tmp_path / "p")
    before = {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir() if p.is_file()}
    assert len(first) == 3 and "index.json" in before
    drawn = []

    def stopped(self, name, *args, **kwargs):  # the second figure's drawing is interrupted
        drawn.append(name)
        if len(drawn) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(plot.Figures, "line", stopped)
    with pytest.raises(KeyboardInterrupt):
        plot.plot_results(rows, tmp_path / "p")
    after = {p.name: p.read_bytes() for p in (tmp_path / "p").iterdir() if p.is_file()}
    assert after == before
    assert [p.name for p in (tmp_path / "p").iterdir() if p.is_dir()] == []  # no staging left


def test_a_report_into_a_runs_checkpoints_is_refused(work: Path) -> None:
    """The run prunes its checkpoints, and a resume refuses files there it did not write."""
    line = refused(["report", "runs/a", "-o", "runs/a/checkpoints/step_000002/report.html"], work)
    assert line == ("dtlab: error: -o/--output 'runs/a/checkpoints/step_000002/report.html' is "
                    "inside the checkpoints of the run 'runs/a', which it prunes and replaces (and "
                    "whose files it refuses beside them); fix: a path outside checkpoints/, e.g. "
                    "-o runs/a/report.html"), line


def test_export_onto_its_checkpoint_names_a_fix_that_works(work: Path) -> None:
    """-o CHECKPOINT is a directory: the fix is a path outside it, never one inside it."""
    ckpt = "runs/a/checkpoints/step_000002"
    line = refused(["export", ckpt, "-o", ckpt], work)
    assert line == (f"dtlab: error: -o/--output '{ckpt}' overlaps the checkpoint '{ckpt}' it is "
                    "read from, or its run's own outputs; fix: choose a path outside the "
                    "checkpoint and its run"), line
