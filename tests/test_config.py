"""Config loading, overrides and the one-line errors for bad input (exit code 2)."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import CONFIGS, cli

from dtlab.cli.main import main
from dtlab.config import Config, ConfigError, check_world, load_config, parse_value, valid_keys


def test_default_config_is_quick_yaml() -> None:
    builtin = load_config(None).model_dump()
    quick = load_config(CONFIGS / "quick.yaml").model_dump()
    assert builtin["run"].pop("dir") == "runs/quick-single"
    assert quick["run"].pop("dir") == "runs/quick-single"
    assert builtin == quick


def test_every_shipped_config_validates() -> None:
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        assert cfg.run.dir == f"runs/{path.stem}-{cfg.strategy.name}"
    assert load_config(CONFIGS / "fsdp_gpt.yaml").model.name == "gpt"


def test_override_values_are_typed() -> None:
    cfg = load_config(None, ["train.lr=1e-3", "model.channels=[8, 16]", "seed=7",
                             "strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=SHARD_GRAD_OP",
                             "run.progress=false", "run.dir=/tmp/x"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.channels == [8, 16] and cfg.seed == 7 and cfg.run.progress is False
    assert cfg.strategy.fsdp1.sharding_strategy == "SHARD_GRAD_OP" and cfg.run.dir == "/tmp/x"
    assert parse_value("2.5e-4") == pytest.approx(2.5e-4)
    assert parse_value("FULL_SHARD") == "FULL_SHARD"


def test_model_section_switches_by_name() -> None:
    cfg = load_config(None, ["model={name: gpt, n_layer: 2}", "data.name=synthetic"])
    assert cfg.model.name == "gpt" and cfg.model.n_layer == 2 and cfg.model.n_head == 4


def test_check_world_returns_micro_batch() -> None:
    cfg = load_config(None, ["strategy.name=ddp", "train.global_batch_size=64",
                             "train.grad_accum_steps=2"])
    assert check_world(cfg, 4) == 8
    with pytest.raises(ConfigError, match="multiple of 24"):
        check_world(cfg, 12)


def test_valid_keys_cover_all_sections() -> None:
    keys = valid_keys()
    for key in ("seed", "strategy.name", "train.global_batch_size", "train.grad_accum_steps",
                "train.max_steps", "train.lr", "run.dir", "model.n_head", "model.channels",
                "strategy.fsdp1.sharding_strategy", "strategy.ddp.bucket_cap_mb"):
        assert key in keys


BAD = [
    # (arguments, text the one-line message must contain)
    (["train.lrr=0.1"], "unknown config key 'train.lrr'; fix: remove it (did you mean 'train.lr'?)"),
    (["train.lr=abc"], "train.lr: Input should be a valid number"),
    (["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (["train.momentum=1.5"], "train.momentum"),
    (["train.max_steps=2.5"], "train.max_steps"),
    (["strategy.name=zero9"], "strategy.name: Input should be 'single', 'ddp', 'fsdp', 'fsdp1'"),
    (["strategy.fsdp1.sharding_strategy=HALF_SHARD"], "strategy.fsdp1.sharding_strategy"),
    (["model.channels=abc"], "model.channels"),
    (["model.channels=[]"], "model.channels"),
    (["model.name=transformer"], "model.name"),
    (["model.name=gpt", "model.n_embd=100", "model.n_head=3"], "model.n_embd=100 is not divisible"),
    (["model.name=gpt", "data.name=cifar10"], "cannot train on data.name=cifar10"),
    (["model.name=resnet", "strategy.name=fsdp", "train.compile=true"], "BatchNorm"),
    (["run.deterministic=true", "run.cudnn_benchmark=true"],
     "run.deterministic=true with run.cudnn_benchmark=true: autotuning picks kernels by timing"),
    (["train.compile=layers"], "train.compile: Input should be 'none', 'model' or 'blocks'"),
    (["--nproc-per-node", "2", "--config", "configs/pp_gpt.yaml", "train.compile=blocks"],
     "train.compile=blocks is not supported with strategy.name=pp"),
    (["strategy.fsdp1.backward_prefetch=SOMETIMES"], "strategy.fsdp1.backward_prefetch"),
    (["train.lr"], "must look like key=value"),
    (["--config", "missing.yaml"], "config file 'missing.yaml' not found"),
    (["--nproc-per-node", "4", "strategy.name=ddp", "train.global_batch_size=2"],
     "train.global_batch_size=2 must be a positive multiple of world_size(4)"),
    (["--nproc-per-node", "2", "strategy.name=ddp", "train.global_batch_size=63"],
     "fix: set train.global_batch_size to a multiple of 2"),
    (["--nproc-per-node", "4", "strategy.name=fsdp1", "strategy.fsdp1.sharding_strategy=HYBRID_SHARD",
      "strategy.fsdp1.shard_group_size=3"], "HYBRID_SHARD cannot split world_size=4"),
    (["--nproc-per-node", "2"], "strategy.name=single runs one process"),
    (["run.device=cuda"], "run.device=cuda but no CUDA device"),
    (["run.tensorboard=true"], "run.tensorboard=true needs the tensorboard package"),
]


@pytest.mark.parametrize(("args", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_exits_2_with_one_line(args: list[str], expected: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    if args[0] == "run.device=cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    if args[0] == "run.tensorboard=true" and importlib.util.find_spec("tensorboard"):
        pytest.skip("tensorboard is installed")
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dtlab: error: ") and expected in lines[0], lines[0]
    assert "fix" in lines[0] or "should be" in lines[0] or "must" in lines[0]


def test_bad_yaml_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [0.1\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "is not valid YAML at line" in capsys.readouterr().err
    bad.write_text("- 1\n- 2\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "must hold a mapping" in capsys.readouterr().err


def test_bad_config_through_the_real_command_has_no_traceback() -> None:
    for args in (["train", "train.global_batch_size=0"],
                 ["train", "--nproc-per-node", "2", "strategy.name=fsdp", "train.global_batch_size=7"],
                 ["compare", "--strategies", "ddp,zero7"]):
        proc = cli(*args, timeout=60)
        assert proc.returncode == 2, proc
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_config_command_prints_resolved_yaml(capsys) -> None:
    assert main(["config", "train.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out
    assert Config.model_validate(__import__("yaml").safe_load(out)).train.lr == 0.5


def test_switching_the_model_over_a_config_of_another_model() -> None:
    """`--config fsdp_gpt.yaml model.name=cnn` is the CNN's defaults plus model.* overrides, as
    without --config; the file's other sections stay."""
    cnn = load_config(CONFIGS / "fsdp_gpt.yaml", ["model.name=cnn"])
    assert cnn.model == load_config(None).model
    assert cnn.train.optimizer == "adamw" and cnn.train.global_batch_size == 32
    assert cnn.strategy.name == "fsdp"
    narrow = load_config(CONFIGS / "fsdp_gpt.yaml", ["model.channels=[8]", "model.name=cnn"])
    assert narrow.model.channels == [8] and narrow.model.hidden == 64
    resnet = load_config(CONFIGS / "fsdp_gpt.yaml", ["model.name=resnet", "model.depth=34"])
    assert resnet.model.name == "resnet" and resnet.model.depth == 34
    gpt = load_config(CONFIGS / "quick.yaml", ["model.name=gpt", "model.n_layer=2"])
    assert gpt.model.n_layer == 2 and gpt.model.n_head == 4
    with pytest.raises(ConfigError, match=r"^config key 'model.n_head' belongs to model.name=gpt, "
                       r"not model.name=cnn; fix: remove model.n_head, or set model.name=gpt"):
        load_config(CONFIGS / "fsdp_gpt.yaml", ["model.name=cnn", "model.n_head=2"])
    with pytest.raises(ConfigError, match="'model.n_layer' belongs to model.name=gpt"):
        load_config(CONFIGS / "fsdp_gpt.yaml", ["model.name=cnn", "model.n_layer=4"])  # as the file


def test_a_value_is_checked_against_its_key_alone() -> None:
    from dtlab.config import check_value

    assert check_value("train.lr", 0.1) is None and check_value("model.n_layer", 2) is None
    assert check_value("strategy.name", "ddp") is None and check_value("run.dir", "x") is None
    assert check_value("train.lr", "fast") == (
        "Input should be a valid number, unable to parse string as a number (got 'fast')")
    assert check_value("model.depth", 50) == "Input should be 18 or 34 (got 50)"
    assert "greater than or equal to 0" in check_value("data.synthetic.noise", -1)
    assert check_value("train.lr_scale_base_batch", None) is None  # null, as YAML writes it
    assert check_value("not.a.key", 1) is None  # unknown keys are reported by the matrix check


def test_unknown_key_suggestions_never_repeat_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name=resnet", "model.hidden=3"])
    assert str(e.value) == ("config key 'model.hidden' belongs to model.name=cnn, not "
                            "model.name=resnet; fix: remove model.hidden, or set model.name=cnn")
    with pytest.raises(ConfigError, match=r"did you mean 'train.lr'\?"):
        load_config(None, ["train.lrr=1"])


def test_the_model_switch_through_the_command_line(capsys) -> None:
    """`dtlab ... --config configs/fsdp_gpt.yaml model.name=cnn`: the CNN, nothing of the GPT."""
    import yaml

    assert main(["config", "--config", str(CONFIGS / "fsdp_gpt.yaml"), "model.name=cnn"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"] == load_config(None).model.model_dump(mode="json")
    assert resolved["strategy"]["name"] == "fsdp" and resolved["train"]["optimizer"] == "adamw"


def test_commands_that_do_no_work_leave_torch_unimported() -> None:
    """Building dtlab's parser (every command's options) and printing a config import no torch:
    a bad option or key is answered at once, not after torch's import (about 1.5 s of CPU). The
    comm options live apart from the benchmark for this (dtlab/comm/arguments.py)."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys\nfrom dtlab.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['config'])\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
