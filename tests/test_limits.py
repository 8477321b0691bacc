"""Integers a run cannot use (a step count, an epoch count or a size far past anything a machine
holds) are refused in one line, exit 2, before any rank starts, and the workspace is left as it
was (dtlab/config/limits.py). Before, they ended in a rank's traceback: islice's "Stop argument
must be ... <= sys.maxsize", torch's "Overflow when unpacking long long", an allocation of
exabytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bad_inputs import refused

from dtlab.config.limits import MAX_INT

HUGE = "99999999999999999999999"
# (id, the command line after `dtlab`, what the one line says); the data and models are
# petabytes, past any machine's memory, not only this one's
CASES = [
    ("max-steps", f"train train.max_steps={HUGE}",
     f"train.max_steps={HUGE} is past what a run can use (at most 2**53 = 9,007,199,254,740,992)"),
    ("epochs", "train train.epochs=100000000000000000000",
     "train.epochs=100000000000000000000 is past what a run can use"),
    ("max-steps-2-ranks", f"train --nproc-per-node 2 strategy.name=ddp train.max_steps={HUGE}",
     f"train.max_steps={HUGE} is past what a run can use"),
    ("config-prints-none", f"config train.warmup_steps={HUGE}",
     f"train.warmup_steps={HUGE} is past what a run can use"),
    ("a-size-in-a-list", f"train model.channels=[16,{HUGE}]",
     f"model.channels={HUGE} is past what a run can use"),
    ("threads", "train run.threads=100000", "run.threads: Input should be less than or equal to 4096"),
    ("synthetic-data", "train data.synthetic.train_samples=1000000000000",
     "samples make 12,296,000.0 GB of synthetic data on each rank, more than this machine's"),
    ("synthetic-data-2-ranks", "train --nproc-per-node 2 strategy.name=ddp "
     "data.synthetic.train_samples=1000000000000", "GB of synthetic data on each rank"),
    ("model", "train model.hidden=1000000000000",
     "model.name=cnn has 2,059,000,000,005,098 parameters, 8,236,000.0 GB in fp32"),
    ("model-2-ranks", "train --nproc-per-node 2 strategy.name=ddp model.name=gpt "
     "model.n_embd=10000000 model.n_head=1", "more than this machine's"),
    ("gpt-that-cannot-be-built", f"train model.name=gpt model.n_embd={MAX_INT} model.n_head=1",
     "model.name=gpt cannot be built with these sizes"),
    ("epochs-times-steps", f"train train.epochs={MAX_INT // 8}",
     f"train.epochs={MAX_INT // 8} of 64 steps are 72,057,594,037,927,936 steps, past what a run "
     "can use (at most 2**53)"),
]


@pytest.mark.parametrize(("line", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_integers_past_what_a_run_can_use_are_refused(tmp_path: Path, line: str,
                                                      expected: str) -> None:
    said = refused(line.split(), tmp_path, quiet=True)
    assert expected in said, said


def test_the_bound_itself_is_allowed() -> None:
    """2**53 is the largest integer a config may hold; the schema's own checks still apply."""
    from dtlab.config import load_config

    assert load_config(None, [f"train.max_steps={MAX_INT}"]).train.max_steps == MAX_INT


@pytest.mark.parametrize("overrides", [[], ["model.name=gpt"], ["model.name=resnet"],
                                       ["model.name=gpt", "model.tie_weights=true"]],
                         ids=["cnn", "gpt", "resnet", "gpt-tied"])
def test_the_size_check_counts_the_parameters_the_run_builds(overrides: list[str]) -> None:
    """check_model_size skips the parameters' initialisation on the meta device (whose random
    fills import torch._dynamo, seconds of a launcher's CPU): the count is the built model's."""
    import torch

    from dtlab.config import load_config
    from dtlab.data import spec_for
    from dtlab.models import _build, _NoInit, count_params

    cfg = load_config(None, overrides)
    with torch.device("meta"), _NoInit():
        skipped = count_params(_build(cfg.model, spec_for(cfg)))
    assert skipped == count_params(_build(cfg.model, spec_for(cfg))) > 0


def test_the_size_check_leaves_torch_dynamo_unimported() -> None:
    import subprocess
    import sys

    code = ("import sys; from dtlab.config import load_config; from dtlab.models import "
            "check_model_size; check_model_size(load_config('configs/tp_gpt.yaml', [])); "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1], check=True).stdout
    assert out.strip() == "[]", out
