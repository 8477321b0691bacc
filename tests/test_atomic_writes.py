"""Every write is whole or absent (issue 26): `dtlab prepare` swaps a complete data set in beside
the old one, meta.json's sizes and checksums let `train` refuse mixed or truncated token files,
and `dtlab export` replaces only an earlier export unless told to. Tiny texts, the bytes
tokenizer, a 2-step GPT; in this process, or in one forked rank where a real signal is sent."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import ranks
from conftest import dtlab, train

from dtlab import atomic_write
from dtlab.data import tokens
from dtlab.errors import DataError
from dtlab.text import prepare as prep

GPT = ["model.name=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
       "model.block_size=16", "model.vocab_size=256", "train.global_batch_size=4",
       "train.max_steps=2", "run.log_every=2", "run.progress=false"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def old_set(tmp_path: Path) -> Path:
    """A data set prepared from one text, with a second, different text beside it."""
    (tmp_path / "old.txt").write_text("the old corpus, line after line\n" * 60)
    (tmp_path / "new.txt").write_text("a new and longer corpus of other words\n" * 90)
    out = tmp_path / "data"
    prep.prepare([str(tmp_path / "old.txt")], out)
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".dtlab-" in p.name)


def one_line(proc: subprocess.CompletedProcess[str], code: int = 2) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------------ prepare
def test_an_interrupt_between_the_two_renames_puts_the_old_set_back(old_set: Path, monkeypatch) -> None:
    """Ctrl-C after the old data set was set aside and before the new one was renamed in: the old set is back, whole, and nothing is left beside it."""
    before = snapshot(old_set)
    real = os.rename

    def rename(src: str, dst: str) -> None:
        if Path(src).name.startswith(".data.dtlab-new-"):
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(atomic_write.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(old_set.parent / "new.txt")], old_set)
    assert snapshot(old_set) == before and leftovers(old_set.parent) == []


def _prepare_signalled_after_train_bin(argv: list[str]) -> int:
    """`dtlab prepare` that receives SIGTERM just after its new train.bin is written."""
    from dtlab import files
    from dtlab.cli.main import main

    real = files.file_sha256

    def sha256(path: Path) -> str:
        if path.name == "train.bin":
            os.kill(os.getpid(), signal.SIGTERM)
        return real(path)

    files.file_sha256 = sha256
    return main(argv)


def _prepare_signalled_between_the_renames(argv: list[str]) -> int:
    """`dtlab prepare` that receives SIGINT just after the old data set was set aside."""
    from dtlab.cli.main import main

    real = os.rename

    def rename(src: str, dst: str) -> None:
        real(src, dst)
        if ".dtlab-old-" in str(dst):
            os.kill(os.getpid(), signal.SIGINT)

    os.rename = rename  # this forked process only
    return main(argv)


def test_sigterm_after_train_bin_leaves_the_old_set_and_train_reads_it(old_set: Path) -> None:
    """SIGTERM to a re-run of prepare just after its new train.bin is written (the issue's case): exit 143, one line, the old set byte for byte, no draft left, and train runs on it."""
    before = snapshot(old_set)
    proc = ranks.start(1, ["prepare", str(old_set.parent / "new.txt"), "--out", str(old_set)],
                       target=_prepare_signalled_after_train_bin, timeout=60)
    assert one_line(proc, 143) == "dtlab: interrupted by SIGTERM"
    assert snapshot(old_set) == before and leftovers(old_set.parent) == []
    run = old_set.parent / "run"
    proc = dtlab("train", *GPT, "data.name=tokens", f"data.dir={old_set}", f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_signal_during_the_swap_waits_for_it(old_set: Path) -> None:
    """SIGINT while the data set is being swapped waits for both renames: exit 130, and the directory is the whole new set (train's checks pass), with nothing left beside it."""
    new = old_set.parent / "new.txt"
    proc = ranks.start(1, ["prepare", str(new), "--out", str(old_set)],
                       target=_prepare_signalled_between_the_renames, timeout=60)
    assert one_line(proc, 130) == "dtlab: interrupted by SIGINT"
    tokens.check_dataset(old_set)
    assert json.loads((old_set / "meta.json").read_text())["sources"] == [str(new)]
    assert sorted(p.name for p in old_set.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert leftovers(old_set.parent) == []


def test_what_a_killed_prepare_left_is_restored_by_the_next_run(old_set: Path) -> None:
    """A prepare killed between the renames (SIGKILL) left the old set aside and a draft: the next prepare puts the old set back and deletes the draft, even when it then fails on its own input."""
    before = snapshot(old_set)
    dead = subprocess.Popen(["true"])  # a pid that no process has any more
    dead.wait()
    os.rename(old_set, old_set.with_name(f".data.dtlab-old-{dead.pid}"))
    draft = old_set.with_name(f".data.dtlab-new-{dead.pid}")
    draft.mkdir()
    (draft / "train.bin").write_bytes(b"\0" * 6)
    (old_set.parent / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    proc = dtlab("prepare", str(old_set.parent / "bad.jsonl"), "--out", str(old_set))
    assert "bad.jsonl:2 is not a JSON object" in one_line(proc)
    assert snapshot(old_set) == before and leftovers(old_set.parent) == []


def test_a_failed_first_prepare_leaves_no_directory(tmp_path: Path) -> None:
    """A prepare into a new nested --out that fails on its input half-way leaves no directory, no draft and no parent it made."""
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n[3]\n')
    proc = dtlab("prepare", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "a" / "b" / "c"))
    assert one_line(proc) == (f"dtlab: error: {tmp_path / 'docs.jsonl'}:3 is not a JSON object "
                              "with a 'text' string; fix: repair the line, or name the field "
                              "with --text-field")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_prepare_refuses_an_out_holding_other_files(old_set: Path) -> None:
    """Prepare refuses an --out that holds files other than a data set (re-preparing would delete them), naming them and the fix; every file stays."""
    (old_set / "notes.md").write_text("mine")
    before = snapshot(old_set.parent)
    proc = dtlab("prepare", str(old_set.parent / "new.txt"), "--out", str(old_set))
    assert one_line(proc) == (
        f"dtlab: error: --out '{old_set}' holds files that are not a token data set (notes.md), "
        "and preparing replaces the whole directory; fix: choose another --out, e.g. "
        f"{old_set / 'tokens'}, or move those files out of it")
    assert snapshot(old_set.parent) == before


def test_a_re_run_replaces_the_set_whole_and_keeps_its_permissions(old_set: Path) -> None:
    """A re-run of prepare replaces the old set with the new one whole (meta.json records each file's bytes and sha256), keeps the directory's permissions, and leaves nothing beside it."""
    old_set.chmod(0o750)
    assert dtlab("prepare", str(old_set.parent / "new.txt"), "--out", str(old_set)).returncode == 0
    meta = json.loads((old_set / "meta.json").read_text())
    for name in ("train.bin", "val.bin"):
        entry = meta["files"][name]
        assert entry["bytes"] == (old_set / name).stat().st_size
        assert entry["sha256"] == hashlib.sha256((old_set / name).read_bytes()).hexdigest()
    assert meta["tokens"]["train"] * 2 == meta["files"]["train.bin"]["bytes"]
    assert old_set.stat().st_mode & 0o777 == 0o750 and leftovers(old_set.parent) == []


# ------------------------------------------------------------------------------ train's checks
def _train_line(data: Path, *launch: str) -> str:
    proc = dtlab("train", *launch, *GPT, "data.name=tokens", f"data.dir={data}",
                 f"run.dir={data.parent / 'run'}")
    return one_line(proc)


def test_a_uint32_train_bin_beside_a_uint16_meta_is_refused(old_set: Path) -> None:
    """A uint32 train.bin beside the uint16 val.bin and meta.json of an earlier prepare (the issue's mixed set) is refused in one line naming the file and the fix, before any rank starts."""
    ids = np.fromfile(old_set / "train.bin", dtype=np.uint16)
    ids.astype(np.uint32).tofile(old_set / "train.bin")
    fix = (f"fix: re-run `dtlab prepare` on the same inputs with --out {old_set} (meta.json lists "
           "them under sources)")
    expected = (f"dtlab: error: {old_set / 'train.bin'} holds {ids.size * 4:,} bytes and meta.json "
                f"says {ids.size * 2:,}: it is truncated or from another prepare run, and would be "
                f"read as the wrong tokens; {fix}")
    assert _train_line(old_set) == expected
    assert _train_line(old_set, "--nproc-per-node", "2", "strategy.name=ddp") == expected
    assert not (old_set.parent / "run").exists()


def test_a_truncated_file_of_an_older_meta_json_is_refused(old_set: Path) -> None:
    """A truncated val.bin is refused by the token count of a meta.json written before sizes were recorded."""
    meta = json.loads((old_set / "meta.json").read_text())
    del meta["files"]
    (old_set / "meta.json").write_text(json.dumps(meta))
    with open(old_set / "val.bin", "r+b") as f:
        f.truncate(20)
    assert _train_line(old_set).startswith(
        f"dtlab: error: {old_set / 'val.bin'} holds 20 bytes and meta.json's "
        f"{meta['tokens']['val']:,} uint16 tokens make {meta['tokens']['val'] * 2:,}: it is "
        "truncated")


def test_a_same_size_file_from_elsewhere_is_refused_by_its_checksum(old_set: Path) -> None:
    """A train.bin of the right size but other content is refused by meta.json's sha256."""
    ids = np.fromfile(old_set / "train.bin", dtype=np.uint16)
    ids[::-1].tofile(old_set / "train.bin")
    assert _train_line(old_set).startswith(
        f"dtlab: error: {old_set / 'train.bin'} does not match the sha256 in meta.json: it was "
        "changed or mixed with another data set after dtlab prepare wrote it; fix: re-run")


def test_a_data_set_without_meta_json_still_trains(old_set: Path) -> None:
    """Token files without meta.json (hand-made, nanoGPT's layout) are read as before: nothing to check them against."""
    (old_set / "meta.json").unlink()
    tokens.check_dataset(old_set)
    assert tokens.open_split(old_set, "val", 256, 16).size > 16
    (old_set / "meta.json").write_text('{"vocab_size": 256}')  # a hand-written one, no sizes
    tokens.check_dataset(old_set)
    with pytest.raises(DataError, match="is not a whole number of uint16 tokens"):
        with open(old_set / "val.bin", "ab") as f:
            f.write(b"x")
        tokens.open_split(old_set, "val", 256, 16)


# ------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    train(run, *GPT, "train.checkpoint_every=2", "data.synthetic.train_samples=16",
          "data.synthetic.val_samples=4")
    return run / "checkpoints" / "step_000002"


def test_export_refuses_to_replace_a_file_it_did_not_write(ckpt: Path, tmp_path: Path) -> None:
    """export -o onto an existing text file is refused in one line naming --overwrite, the file intact; with --overwrite it is replaced."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert one_line(dtlab("export", str(ckpt), "-o", str(notes))) == (
        f"dtlab: error: -o/--output '{notes}' is a file that dtlab export did not write, and "
        "exporting would replace it; fix: choose another -o, or add --overwrite to replace it")
    assert notes.read_text() == "my notes"
    proc = dtlab("export", str(ckpt), "-o", str(notes), "--overwrite")
    assert proc.returncode == 0 and proc.stdout == f"replaced (--overwrite): {notes}\n", proc.stderr
    from safetensors.torch import load_file

    assert load_file(notes) and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_export_replaces_an_earlier_export_of_the_same_kind(ckpt: Path, tmp_path: Path) -> None:
    """An earlier export is replaced without --overwrite (safetensors file, and HF directory); an HF directory that gained other files, or a file in place of the directory, is refused."""
    model, hf = tmp_path / "model.safetensors", tmp_path / "hf"
    for _ in range(2):
        assert dtlab("export", str(ckpt), "-o", str(model)).returncode == 0
        proc = dtlab("export", str(ckpt), "--format", "hf", "-o", str(hf))
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.safetensors"]
    (hf / "tokenizer.json").write_text("{}")
    assert one_line(dtlab("export", str(ckpt), "--format", "hf", "-o", str(hf))) == (
        f"dtlab: error: -o/--output '{hf}' is a directory holding files dtlab export did not "
        "write (tokenizer.json), which exporting there would delete; fix: choose another -o, or "
        "move them out of it")
    assert one_line(dtlab("export", str(ckpt), "-o", str(hf / "config.json"))).endswith(
        f"is inside the Hugging Face export '{hf}', whose config and weights would no longer "
        f"match; fix: export --format hf -o {hf} to replace that export, or another -o")
    assert (hf / "tokenizer.json").exists()
    # --overwrite replaces what is not an export, never the user's files beside an export
    assert one_line(dtlab("export", str(ckpt), "--format", "hf", "-o", str(hf), "--overwrite")) \
        .endswith("which exporting there would delete; fix: choose another -o, or move them out of it")
    assert (hf / "tokenizer.json").read_text() == "{}"


def test_export_never_replaces_the_checkpoint_or_its_run(ckpt: Path) -> None:
    """export -o naming the checkpoint's run directory, or a file inside the checkpoint, is refused even with --overwrite."""
    run = ckpt.parent.parent
    before = snapshot(run)
    for args in (["--format", "hf", "-o", str(run)], ["-o", str(ckpt / ".metadata")],
                 ["-o", str(run / "model.safetensors")]):  # would pass for the run's final model
        line = one_line(dtlab("export", str(ckpt), *args, "--overwrite"))
        assert "overlaps the checkpoint" in line and "; fix: choose a path outside" in line
    assert snapshot(run) == before


def test_a_failed_export_leaves_nothing(ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    """An export that fails while writing (a full disk) into a new nested path leaves no file, no draft and no directory it made."""
    import safetensors.torch

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "a" / "b" / "m.safetensors"
    assert one_line(dtlab("export", str(ckpt), "-o", str(out))).startswith(
        f"dtlab: error: no space left on device while writing '{out}'; fix: ")
    assert list(tmp_path.iterdir()) == []
