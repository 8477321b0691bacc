"""`dtlab export --format hf`: a directory that transformers' GPT2LMHeadModel loads and that
computes dtlab's logits; sharding with an index; the GPT <-> GPT-2 mapping both ways; refusals."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dtlab, train
from safetensors.torch import load_file

from dtlab.config import GPTConfig
from dtlab.models import GPT
from dtlab.models.gpt_hf import from_gpt2, to_gpt2
from dtlab.text.export import checkpoint_model, parse_size

SHAPE = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=64)
TINY = (*(f"model.{k}={v}" for k, v in SHAPE.items()), "model.name=gpt", "train.max_steps=2",
        "train.checkpoint_every=2", "train.global_batch_size=4",
        "data.synthetic.train_samples=64", "data.synthetic.val_samples=8")
KINDS = {"bias": ("model.bias=true",), "nobias_tied": ("model.bias=false", "model.tie_weights=true")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


def checkpoint(runs: Path, kind: str, *extra: str, nproc: int = 1) -> Path:
    """The checkpoint of a 2-step run of the tiny GPT, trained once per module."""
    run = runs / kind
    if not run.exists():
        train(run, *TINY, *KINDS.get(kind, ()), *extra, nproc=nproc)
    return run / "checkpoints" / "step_000002"


def export_hf(ckpt: Path, out: Path, *args: str) -> Path:
    proc = dtlab("export", str(ckpt), "--format", "hf", "-o", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"written: {out}"
    return out


def weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_logits_match(ckpt: Path, out: Path) -> None:
    """transformers on CPU in fp32 computes what dtlab's model of the checkpoint computes."""
    transformers = pytest.importorskip("transformers")
    _, model = checkpoint_model(ckpt)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert hf.dtype == torch.float32
    ids = torch.randint(0, SHAPE["vocab_size"], (3, SHAPE["block_size"]),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf.eval()(ids).logits - model.eval()(ids)).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("bias,tie", [(True, False), (False, True), (True, True)])
def test_the_gpt2_layout_round_trip_is_exact(bias: bool, tie: bool) -> None:
    cfg = GPTConfig(**SHAPE, bias=bias, tie_weights=tie, dropout=0.1)
    state = GPT(**SHAPE, dropout=0.1, bias=bias, tie_weights=tie).state_dict()
    config, tensors = to_gpt2(cfg, state)
    hf = dict(tensors)
    assert json.loads(json.dumps(config))["n_positions"] == SHAPE["block_size"]
    assert config["tie_word_embeddings"] is tie and ("lm_head.weight" in hf) is not tie
    n = SHAPE["n_embd"]
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (n, 3 * n)  # Conv1D: [in, out]
    assert hf["transformer.h.1.mlp.c_fc.weight"].shape == (n, 4 * n)
    assert not hf["transformer.h.0.attn.c_attn.bias"][n:2 * n].any()  # dtlab has no key bias
    assert bias or not any(v.any() for k, v in hf.items() if k.endswith(".bias"))
    model, back = from_gpt2(config, hf)
    assert GPTConfig.model_validate(model) == cfg
    back = list(back)
    assert [k for k, _ in back] == list(state)
    assert all(torch.equal(v, state[k]) for k, v in back)
    with pytest.raises(ValueError, match="activation_function='gelu_new'"):
        from_gpt2({**config, "activation_function": "gelu_new"}, hf)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_exported_directory_computes_dtlabs_logits(runs: Path, kind: str) -> None:
    ckpt = checkpoint(runs, kind)
    out = runs / f"{kind}-hf"
    out.mkdir()  # an empty directory is taken
    export_hf(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = dtlab("export", str(ckpt), "--format", "hf", "-o", str(out))  # said, not silent
    assert again.stdout.strip() == f"replaced the earlier export: {out}", again.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu" and config["layer_norm_epsilon"] == 1e-5
    assert config["tie_word_embeddings"] is (kind == "nobias_tied")
    assert_logits_match(ckpt, out)


def test_a_2_rank_fsdp_checkpoint_exports_as_a_single_run_would(runs: Path) -> None:
    ckpt = checkpoint(runs, "fsdp", "model.bias=true", "strategy.name=fsdp", nproc=2)
    assert len(list(ckpt.glob("*.distcp"))) == 2  # each rank wrote its shards
    got = weights(export_hf(ckpt, runs / "fsdp-hf"))
    cfg, model = checkpoint_model(ckpt)  # the whole model read at once, in one process
    assert {k: v for k, v in to_gpt2(cfg.model, model.state_dict())[1]}.keys() == got.keys()
    assert all(torch.equal(v, got[k]) for k, v in to_gpt2(cfg.model, model.state_dict())[1])
    single = weights(export_hf(checkpoint(runs, "bias"), runs / "single-hf"))
    assert all(torch.allclose(got[k], single[k], rtol=1e-4, atol=1e-6) for k in single)
    assert_logits_match(ckpt, runs / "fsdp-hf")


def test_sharding_writes_an_index_and_loads_the_same(runs: Path) -> None:
    ckpt = checkpoint(runs, "bias")
    out = export_hf(ckpt, runs / "sharded", "--max-shard-size", "5KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = {}
    for name in shards:
        part = load_file(out / name)
        assert set(part) == {k for k, f in index["weight_map"].items() if f == name}
        assert len(part) == 1 or sum(t.nbytes for t in part.values()) <= 5000
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    whole = weights(export_hf(ckpt, runs / "unsharded"))
    assert tensors.keys() == whole.keys() and all(torch.equal(tensors[k], whole[k]) for k in whole)
    assert_logits_match(ckpt, out)


def test_sizes_read_as_hugging_face_reads_them() -> None:
    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "1.5kb", "1000")] == [
        5 * 10**9, 500 * 10**6, 2 * 2**30, 1500, 1000]


def refused(*args: str) -> str:
    proc = dtlab("export", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("dtlab: error: ") and "; fix: " in lines[0], lines[0]
    return lines[0]


def test_bad_inputs_are_one_line(runs: Path, tmp_path: Path) -> None:
    ckpt = str(checkpoint(runs, "bias"))
    cnn = Path(shutil.copytree(ckpt, tmp_path / "cnn"))  # the manifest is outside its checksums
    manifest = json.loads((cnn / "dtlab-checkpoint.json").read_text())
    manifest["config"]["model"] = {"name": "cnn"}
    (cnn / "dtlab-checkpoint.json").write_text(json.dumps(manifest))
    line = refused(str(cnn), "--format", "hf", "-o", str(tmp_path / "out"))
    assert "--format hf exports language models (model.name=gpt, model.name=hf)" in line
    assert "holds model.name=cnn; fix: use --format safetensors" in line
    for size in ("lots", "0", "12XB"):
        line = refused(ckpt, "--format", "hf", "-o", str(tmp_path / "out"), "--max-shard-size", size)
        assert line.startswith(f"dtlab: error: --max-shard-size '{size}' is not a size"), line
        assert "e.g. --max-shard-size 2GB" in line
    assert "--max-shard-size applies to --format hf" in refused(ckpt, "--max-shard-size", "1GB")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert refused(ckpt, "--format", "hf", "-o", str(full)) == (
        f"dtlab: error: -o/--output '{full}' is a directory holding files dtlab export did not "
        "write (keep.txt), which exporting there would delete; fix: choose another -o, or move "
        "them out of it")
    assert refused(ckpt, "--format", "hf", "-o", str(full), "--overwrite").startswith(
        f"dtlab: error: -o/--output '{full}' is a directory holding files")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    line = refused(ckpt, "--format", "hf", "-o", str(full / "keep.txt"))
    assert "is a file, not a directory; fix: name a new directory" in line
    assert not (tmp_path / "out").exists()


def test_a_failed_write_leaves_no_directory(runs: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    calls = []

    def save_file(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args, **kwargs)

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "out"
    line = refused(str(checkpoint(runs, "bias")), "--format", "hf", "-o", str(out),
                   "--max-shard-size", "5KB")
    assert line.startswith(f"dtlab: error: no space left on device while writing '{out}'; fix: ")
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its hidden draft


def test_the_checkpoint_is_read_one_block_at_a_time(runs: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import dtlab.text.export

    reads: list[list[str]] = []

    def dcp_load(tensors: dict, path: Path) -> None:
        reads.append(sorted(tensors["model"]))
        real(tensors, path)

    real = dtlab.text.export.dcp_load
    monkeypatch.setattr(dtlab.text.export, "dcp_load", dcp_load)
    export_hf(checkpoint(runs, "nobias_tied"), runs / "by-block")
    blocks = [r for r in reads if r[0].startswith("h.")]
    assert [{k.split(".")[1] for k in r} for r in blocks] == [{"0"}, {"1"}]  # once each, alone
    assert all(len(r) == 1 for r in reads if r not in blocks)
    assert ["lm_head.weight"] not in reads  # tied: the head is the embedding, not read again
