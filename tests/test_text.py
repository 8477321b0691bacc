"""Real text: `dtlab prepare` writes the token files (bytes, a tokenizer trained here with
`tokenizers`, several worker processes), `data.name=tokens` reads them (uint16 and uint32), a GPT
trains on them and `dtlab sample` writes text from the run and from its checkpoint. Everything in
this process (1-rank runs)."""

from __future__ import annotations

import json
import math
import random
import resource
import sys
from pathlib import Path

import numpy as np
import pytest
import ranks
from conftest import dtlab

from dtlab.data import tokens
from dtlab.text import prepare as prep
from dtlab.text import tokenizer

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hum")


def text(lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines))


def read(folder: Path, split: str) -> np.ndarray:
    meta = json.loads((folder / "meta.json").read_text())
    return np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"])


def test_bytes_split_the_text_exactly(tmp_path: Path) -> None:
    corpus = text(200) + "\nnaïve café ✓"  # multi-byte characters stay whole bytes
    (tmp_path / "a.txt").write_text(corpus, encoding="utf-8")
    proc = dtlab("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    raw = corpus.encode("utf-8")
    val = math.ceil(len(raw) * 0.1)
    assert f"1 document -> {len(raw) - val:,} train and {val:,} val tokens (uint16, vocabulary 256" \
        in proc.stdout
    train, valid = read(tmp_path / "d", "train"), read(tmp_path / "d", "val")
    assert bytes(np.concatenate([train, valid]).astype(np.uint8)) == raw
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["tokenizer"] == {"kind": "bytes"} and meta["tokens"] == {"train": len(raw) - val,
                                                                          "val": val}
    assert not list((tmp_path / "d").glob("*.tmp")) and not (tmp_path / "d" / ".tokens.tmp").exists()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained on this module's text, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text(300, seed=1)], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_local_tokenizer_encodes_each_document_and_ends_it(tmp_path: Path, bpe: Path) -> None:
    from tokenizers import Tokenizer

    docs = [text(5, seed=s) for s in range(40)]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs) + "\n")
    proc = dtlab("prepare", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "d"),
                 "--tokenizer", str(bpe), "--text-field", "body")
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, eos]]
    d = tmp_path / "d"
    assert np.concatenate([read(d, "train"), read(d, "val")]).tolist() == expected
    meta = json.loads((d / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eos"], meta["documents"]) == (tok.get_vocab_size(), eos, 40)
    assert meta["tokenizer"] == {"kind": "hf", "path": str((bpe / "tokenizer.json").resolve())}
    again = tokenizer.from_meta(d)  # what `dtlab sample` decodes a run on this data with
    assert again is not None and again.decode(expected[: expected.index(eos)]) == docs[0]


def test_worker_processes_write_the_same_files(tmp_path: Path, bpe: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.txt").write_text(text(100, seed=10 + i))
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2000)  # several chunks per worker
    outs = []
    for workers, pool_from in ((1, 1 << 30), (2, 0)):
        monkeypatch.setattr(prep, "POOL_FROM_BYTES", pool_from)
        out = tmp_path / f"w{workers}"
        meta = prep.prepare([str(tmp_path / "in")], out, str(bpe), 0.2, workers=workers)
        outs.append((meta, (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()))
    assert outs[0] == outs[1] and outs[0][0]["documents"] == 3


def test_uint32_token_files_are_read(tmp_path: Path) -> None:
    ids = np.arange(70_000, 70_200, dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 70_200, "dtype": "uint32"}))
    got = tokens.open_split(tmp_path, "train", vocab_size=70_200, seq_len=16)
    assert got.dtype == np.uint32 and got.tolist() == ids.tolist()


@pytest.mark.parametrize(("args", "message"), [
    (["absent.txt"], "absent.txt not found; fix: pass text files"),
    (["{tmp}/a.csv"], "a.csv: unknown kind of file '.csv'; fix: pass .txt, .md, .jsonl or .parquet"),
    (["{tmp}/bad.jsonl"], "bad.jsonl:2 is not a JSON object with a 'text' string; fix:"),
    (["{tmp}/a.txt", "--val-fraction", "1"], "--val-fraction 1.0 leaves nothing to train on"),
    (["{tmp}/a.txt", "--tokenizer", "{tmp}"], "no tokenizer.json there; fix: pass a Hugging Face"),
    (["{tmp}/tiny.txt"], "the inputs give 1 tokens, too few for a train and a validation split"),
    (["{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text (byte 3); fix: convert it"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "a.txt").write_text(text(3))
    (tmp_path / "tiny.txt").write_text("a")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    proc = dtlab("prepare", *(a.format(tmp=tmp_path) for a in args), "--out", str(tmp_path / "o"),
                 cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def _prepare_with_a_100_kb_file_limit(argv: list[str]) -> int:
    from dtlab.cli.main import main

    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    return main(argv)


def test_a_refused_write_is_one_line_and_leaves_no_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(text(3000))  # 180 kB of text: 360 kB of uint16 tokens
    out = tmp_path / "d"
    proc = ranks.start(1, ["prepare", str(tmp_path / "a.txt"), "--out", str(out)],
                       target=_prepare_with_a_100_kb_file_limit)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "dtlab: error: file too large for the file-size limit (ulimit -f) while writing the token "
        f"files in '{out}'; fix: raise the limit (ulimit -f unlimited), or set --out elsewhere")
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no --out, no hidden draft


def test_without_tokenizers_a_local_tokenizer_is_one_line(tmp_path: Path, bpe: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text(text(3))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    proc = dtlab("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--tokenizer",
                 str(bpe))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "dtlab: error: a Hugging Face tokenizer needs the `tokenizers` package; fix: pip install "
        "'dtlab[hf]'")


TINY_GPT = ["model.name=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
            "model.block_size=32", "model.vocab_size=256", "train.global_batch_size=16",
            "train.optimizer=adamw", "train.lr=0.01", "train.max_steps=40", "train.warmup_steps=0",
            "run.log_every=40", "run.progress=false", "run.save_model=true",
            "train.checkpoint_every=40"]


def test_prepare_train_sample(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(text(600))
    assert dtlab("prepare", "notes.txt", "--out", "data/notes", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "n"
    proc = dtlab("train", *TINY_GPT, "data.name=tokens", "data.dir=data/notes", f"run.dir={run}",
                 cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_train_loss"] < math.log(256) - 2  # it learned the words' letters
    args = ["--prompt", "the quick", "--tokens", "60", "--seed", "3"]
    first = dtlab("sample", str(run), *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("the quick") and len(first.stdout) > len("the quick") + 20
    alphabet = set("".join(WORDS) + " \n")  # what the text is made of
    new = first.stdout[len("the quick"):]
    assert sum(c in alphabet for c in new) >= 0.9 * len(new), new
    # the same seed, the same text; the checkpoint holds the same weights as model.safetensors
    assert dtlab("sample", str(run), *args, cwd=tmp_path).stdout == first.stdout
    ckpt = run / "checkpoints" / "step_000040"
    assert dtlab("sample", str(ckpt), *args, cwd=tmp_path).stdout == first.stdout
    other = dtlab("sample", str(run), "--prompt", "the quick", "--tokens", "60", "--seed", "4",
                  cwd=tmp_path)
    assert other.returncode == 0 and other.stdout != first.stdout  # another seed, another text
    greedy = [dtlab("sample", str(run), "--prompt", "the", "--temperature", "0", "--seed", seed,
                    cwd=tmp_path).stdout for seed in ("1", "2")]
    assert greedy[0] == greedy[1] and greedy[0].startswith("the")  # the argmax: no randomness
    bigger = dtlab("train", *TINY_GPT, "model.vocab_size=200", "data.name=tokens",
                   "data.dir=data/notes", f"run.dir={tmp_path / 'r2'}", cwd=tmp_path)
    assert bigger.returncode == 2 and "model.vocab_size=200; fix: set model.vocab_size to at " \
        "least 256" in bigger.stderr


def test_sample_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    proc = dtlab("sample", str(tmp_path))
    assert proc.returncode == 2 and "is neither a run directory (config.yaml) nor a checkpoint" \
        in proc.stderr
    proc = dtlab("sample", str(tmp_path / "absent"))
    assert proc.returncode == 2 and "RUN_OR_CHECKPOINT" in proc.stderr and "not found" in proc.stderr


def test_without_datasets_a_hub_dataset_is_one_line(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    proc = dtlab("prepare", "someone/corpus", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "dtlab: error: someone/corpus: a Hugging Face dataset needs the `datasets` package; fix: "
        "pip install 'dtlab[datasets]', or pass local text files")
