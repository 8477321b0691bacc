"""Issue 26's bad inputs of models, configs and dumps: each is exit 2 and exactly one line naming
the input and the fix, before any rank starts, with no traceback and every file left as it was.

The Hugging Face model directories are built here (a tiny Llama saved with save_pretrained, a
BERT, and copies of the Llama with one thing broken); nothing comes from the hub. Every case runs
in this process (conftest's `dtlab()`).
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import CONFIGS, needs
from test_bad_inputs import refused

pytestmark = needs("transformers", "hf")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
GPT = "model.name=gpt model.n_layer=1 model.n_head=2 model.n_embd=16 model.block_size=8 " \
      "model.vocab_size=32"
HF = "train model.name=hf model.block_size=16 run.dir={ws}/run model.hf.path={ws}/hf/"


def config_json(d: Path, **changes: object) -> None:
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, **changes}))


def cut(file: Path, keep: int) -> None:
    """The first `keep` bytes of file (negative: all but the last -keep)."""
    file.write_bytes(file.read_bytes()[:keep])


def split_in_two_shards_and_lose_one(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002"
                                            ".safetensors", "lm_head.weight": "model-00002-of-00002"
                                            ".safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def hf_dirs(root: Path) -> None:
    """llama: a good directory; the others: a copy with one thing wrong."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(root / "llama")
    bert = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4)
    transformers.BertModel(bert).save_pretrained(root / "bert")
    broken = {
        "misspelt": lambda d: config_json(d, num_hiden_layers=2),
        "no_weights": lambda d: (d / "model.safetensors").unlink(),
        "truncated": lambda d: cut(d / "model.safetensors", -100),
        "cut_header": lambda d: cut(d / "model.safetensors", 5),
        "not_safetensors": lambda d: (d / "model.safetensors").write_text("hello"),
        "gpt2_config": lambda d: config_json(d, model_type="gpt2", n_embd=32, n_layer=1,
                                             n_head=4, architectures=["GPT2LMHeadModel"]),
        "wider_config": lambda d: config_json(d, hidden_size=64),
        "five_heads": lambda d: config_json(d, num_attention_heads=5),
        "vocab_0": lambda d: config_json(d, vocab_size=0),
        "unknown_type": lambda d: config_json(d, model_type="llamma"),
        "missing_shard": split_in_two_shards_and_lose_one,
    }
    for name, breaks in broken.items():
        shutil.copytree(root / "llama", root / name)
        breaks(root / name)


def sample_runs(root: Path) -> None:
    """Run directories as `dtlab sample` reads them (config.yaml + model.safetensors), the
    weights truncated, not safetensors, or of another model."""
    import torch
    from safetensors.torch import save_file

    from dtlab.config import load_config, to_yaml
    from dtlab.data import spec_for
    from dtlab.models import build_model

    cfg = load_config(None, GPT.split())
    for name in ("truncated", "not_safetensors", "other_model"):
        run = root / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(to_yaml(cfg))
        save_file(build_model(cfg.model, spec_for(cfg)).state_dict(), str(run / "model.safetensors"))
    cut(root / "truncated" / "model.safetensors", -64)
    (root / "not_safetensors" / "model.safetensors").write_text("junk\n")
    save_file({"x": torch.zeros(2)}, str(root / "other_model" / "model.safetensors"))


ENTRY = {"collective_seq_id": 1, "process_group": ["0", "default_pg"],
         "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"]}
DUMPS = {
    "a_list": [1, 2],
    "no_keys": {"entries": []},
    "bad_entry": {"version": "2.10", "pg_config": {}, "entries": [{"collective_seq_id": "one"}]},
    "bad_time": {"version": "2.10", "pg_config": {}, "entries": [ENTRY],
                 "dtlab": {"time": "yesterday", "reason": "stopped", "world_size": 2}},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("bad_inputs_26")
    hf_dirs(ws / "hf")
    sample_runs(ws / "sample")
    for name, dump in DUMPS.items():
        (ws / "hang" / name / "flight_recorder").mkdir(parents=True)
        (ws / "hang" / name / "flight_recorder" / "rank0.json").write_text(json.dumps(dump))
    return ws


CASES = [
    # ---------------------------------------------------------- Hugging Face model directories
    ("a misspelt field in a model directory's config.json gets the closest name",
     HF + "misspelt", "config.json field 'num_hiden_layers' is not a field of LlamaConfig (did "
     "you mean 'num_hidden_layers'?); fix: rename it in"),
    ("a model directory without weights is refused", HF + "no_weights",
     "holds no weights (model.safetensors); fix: point it at a directory with its weights"),
    ("a model directory's safetensors file cut short is refused", HF + "truncated",
     "model.safetensors' is not a complete safetensors file (Error while deserializing header: "
     "incomplete metadata"),
    ("a model directory's safetensors file cut inside its header is refused", HF + "cut_header",
     "model.safetensors' is not a complete safetensors file"),
    ("a model directory's weights file that is not safetensors is refused",
     HF + "not_safetensors", "model.safetensors' is not a complete safetensors file"),
    ("a config.json naming a model type transformers does not know is refused",
     HF + "unknown_type", "config.json names model_type='llamma', which this transformers does "
     "not know; fix: correct it there"),
    ("a sharded model directory missing a shard is refused", HF + "missing_shard",
     "model.safetensors.index.json lists the shard model-00002-of-00002.safetensors, which is "
     "not in"),
    ("a config.json whose model_type does not match its weights is refused (no random weights)",
     HF + "gpt2_config", "its weights do not fit its config.json (model_type=gpt2: 16 tensor(s) "
     "the model needs are missing (e.g. 'transformer.h.0.attn.c_attn.bias'), and 11 it has no "
     "place for (e.g. 'model.embed_tokens.weight')); fix: use the config.json written with"),
    ("a config.json whose sizes do not match its weights is refused", HF + "wider_config",
     "tensor(s) of another shape, e.g. 'lm_head.weight' [64, 32] in the files, [64, 64] in the "
     "model"),
    ("a shape override on top of model.hf.path is refused, naming the override",
     HF + "llama model.hf.config.hidden_size=64", "model.hf.config override(s) hidden_size "
     "change the shapes of the weights in model.hf.path"),
    ("a model_type override that contradicts model.hf.path is refused",
     HF + "llama model.hf.config.model_type=gpt2", "model.hf.config.model_type=gpt2, but "
     "model.hf.path"),
    ("an encoder directory (BERT) is refused as a causal LM", HF + "bert",
     "model_type=bert is an encoder (is_decoder: false), whose attention sees the tokens it "
     "predicts; fix: use a decoder-only model"),
    ("compare refuses an encoder directory once, before any run starts",
     "compare --strategies single,ddp --nproc-per-node 2 --out {ws}/compare model.name=hf "
     "model.block_size=16 model.hf.path={ws}/hf/bert", "model_type=bert is an encoder"),
    ("an encoder given by config fields is refused",
     "train model.name=hf model.hf.config.model_type=bert run.dir={ws}/run",
     "model.hf.config: model_type=bert is an encoder"),
    ("attention heads that do not divide the width in config.json are refused",
     HF + "five_heads", "The hidden size (32) is not a multiple of the number of attention "
     "heads (5)"),
    ("key/value heads that do not divide the attention heads are refused",
     HF + "llama model.hf.config.num_key_value_heads=3", "model.hf.config.num_key_value_heads=3 "
     "does not divide num_attention_heads=4; fix: choose num_key_value_heads among the divisors"),
    ("GPT-2 heads that do not divide the width are refused",
     "train model.name=hf model.hf.config.model_type=gpt2 model.hf.config.n_head=5",
     "model.hf.config: transformers cannot build GPT2 from these fields (ValueError: `embed_dim` "
     "must be divisible by num_heads (got `embed_dim`: 768 and `num_heads`: 5).); fix: correct "
     "the field behind it (given: n_head)"),
    ("vocab_size=0 in config.json is refused", HF + "vocab_0",
     "config.json's vocab_size=0: a size must be at least 1; fix: set vocab_size to a positive "
     "number in"),
    ("vocab_size=0 as a config field is refused",
     "train model.name=hf model.hf.config.model_type=llama model.hf.config.vocab_size=0",
     "model.hf.config.vocab_size=0: a size must be at least 1"),
    ("a negative layer count as a config field is refused",
     "train model.name=hf model.hf.config.model_type=llama model.hf.config.num_hidden_layers=-1",
     "model.hf.config.num_hidden_layers=-1: a size must be at least 1"),
    ("an activation transformers does not know is refused with the closest name",
     "train model.name=hf model.hf.config.model_type=llama model.hf.config.hidden_act=selu",
     "model.hf.config.hidden_act='selu' is not an activation transformers knows; fix: name one "
     "it does (did you mean silu?)"),
    ("text where the config has a number (rope_theta, converted by transformers) is refused",
     "train model.name=hf model.hf.config.model_type=llama model.hf.config.rope_theta=abc",
     "model.hf.config.rope_theta='abc': LlamaConfig's rope_theta is a number; fix: give it one"),
    ("a model transformers cannot build with dtlab's attention is refused before any rank",
     "train model.name=hf model.hf.config.model_type=gemma2 model.hf.config.num_hidden_layers=1",
     "model.hf.config: transformers cannot build Gemma2 from these fields (ValueError: "),
    # ------------------------------------------------------------------------ dtlab's own GPT
    ("dtlab's GPT with heads that do not divide the width is refused",
     "train model.name=gpt model.n_head=3", "model.n_embd=128 is not divisible by model.n_head=3"),
    ("dtlab's GPT with vocab_size=0 is refused", "train model.name=gpt model.vocab_size=0",
     "model.vocab_size: Input should be greater than 0 (got 0)"),
    # --------------------------------------------------------------------------- combinations
    ("fsdp1 with a compiled model is refused before start",
     "train --nproc-per-node 2 strategy.name=fsdp1 train.compile=model",
     "train.compile=model with strategy.name=fsdp1 fails at the first evaluation"),
    ("fsdp1 with compiled blocks is refused before start",
     "train --nproc-per-node 2 " + GPT + " strategy.name=fsdp1 train.compile=blocks",
     "train.compile=blocks with strategy.name=fsdp1 fails at the first evaluation"),
    # ------------------------------------------------------------------------------ config keys
    ("a misspelt section is matched key segment by key segment", "train trian.max_steps=3",
     "unknown config key 'trian'; fix: remove it (did you mean 'train.max_steps'?)"),
    ("a misspelt strategy section gets the key it meant", "train stratgy.name=ddp",
     "(did you mean 'strategy.name'?)"),
    ("a misspelt option of another model names that model", "train model.n_lyer=2",
     "(did you mean 'model.n_layer', an option of model.name=gpt?)"),
    ("a bad value of a true/false/auto key names the key, not a type",
     "train model.channels_last=maybe", "model.channels_last: Input should be a valid boolean or "
     "'auto' (got 'maybe'); fix: set model.channels_last to a valid value"),
    ("a bad progress setting names run.progress", "train run.progress=sometimes",
     "run.progress: Input should be a valid boolean or 'auto'"),
    # ------------------------------------------------------------------------- doctor hang
    ("doctor hang on a JSON list names the file and the shape it expects",
     "doctor hang {ws}/hang/a_list", "rank0.json' is not a flight-recorder dump (a list, not an "
     "object); fix: move it out of"),
    ("doctor hang on a JSON object without a dump's keys is refused",
     "doctor hang {ws}/hang/no_keys", "is not a flight-recorder dump (no version, pg_config)"),
    ("doctor hang on an entry of the wrong types is refused", "doctor hang {ws}/hang/bad_entry",
     "is not a flight-recorder dump (entry 0 has no collective_seq_id of type int)"),
    ("doctor hang on a header with a time that is not one is refused",
     "doctor hang {ws}/hang/bad_time", "its dtlab header's time 'yesterday' is not an ISO time"),
    # ----------------------------------------------------------------------------------- sample
    ("sample on a model.safetensors cut short is refused",
     "sample {ws}/sample/truncated --prompt 1", "model.safetensors' is not a complete "
     "safetensors file"),
    ("sample on a model.safetensors that is not safetensors is refused",
     "sample {ws}/sample/not_safetensors --prompt 1", "is not a complete safetensors file"),
    ("sample on another model's weights is refused",
     "sample {ws}/sample/other_model --prompt 1", "does not hold the weights of the model in its "
     "config.yaml"),
]


@pytest.mark.parametrize(("what", "line", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_rank(workspace: Path, what: str, line: str,
                                                expected: str) -> None:
    """Refused in one line naming the input and the fix, exit 2, nothing started or written."""
    line = refused(shlex.split(line.format(ws=workspace)), workspace)
    assert expected in line, line


def test_the_readme_command_trains_the_directory_model(workspace: Path) -> None:
    """`--config configs/hf_llama.yaml model.hf.path=DIR` (the README's) builds DIR's model."""
    from dtlab.config import load_config
    from dtlab.models import check_model
    from dtlab.models.hf import hf_config

    cfg = load_config(CONFIGS / "hf_llama.yaml", [f"model.hf.path={workspace / 'hf' / 'llama'}"])
    assert cfg.model.hf.config is None  # the file's Llama sizes are not laid over DIR's
    check_model(cfg.model)
    assert hf_config(cfg.model).hidden_size == TINY["hidden_size"]
    kept = load_config(CONFIGS / "hf_llama.yaml", [f"model.hf.path={workspace / 'hf' / 'llama'}",
                                                   "model.hf.config.attention_dropout=0.1"])
    assert kept.model.hf.config == {"attention_dropout": 0.1}  # given beside the path: kept
    check_model(kept.model)


def test_extra_metadata_in_config_json_is_not_a_misspelling(workspace: Path,
                                                           tmp_path: Path) -> None:
    """A config.json with keys other tools write (dtlab's export adds `dtlab`) is accepted."""
    from dtlab.config import load_config
    from dtlab.models import check_model

    d = tmp_path / "llama"
    shutil.copytree(workspace / "hf" / "llama", d)
    config_json(d, dtlab={"bias": False}, _name_or_path="somewhere", custom_note="trained here")
    check_model(load_config(None, ["model.name=hf", f"model.hf.path={d}"]).model)
