"""train.compile=blocks: each block compiled before FSDP2 wraps it keeps the eager losses,
composes with activation checkpointing, and leaves the parameter names of the checkpoint
unchanged. One FSDP2 rank: its hooks (all-gather, reduce-scatter) run around each compiled block
as with more ranks. The backend is aot_eager (dynamo's capture and AOTAutograd, eager kernels):
a cold inductor compile of these graphs costs ~30 s on this CPU, and inductor's generated kernels
are checked by tests/test_train_features.py (ddp, compile=model, 2 ranks, within 1e-5);
blocks + inductor kept the losses within 1e-5 here too (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from conftest import CONFIGS, step_losses, train
from safetensors import safe_open

# Dropout off: compiled dropout draws from inductor's own RNG, not eager's. Every batch the same
# size (eval too), so that each block compiles once.
TINY_GPT = ("model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "data.synthetic.train_samples=256", "data.synthetic.val_samples=32",
            "data.val_batch_size=8", "train.global_batch_size=16", "train.max_steps=6",
            "train.checkpoint_every=0", "model.dropout=0.0", "strategy.name=fsdp",
            "run.save_model=true")


def keys(run: Path) -> list[str]:
    with safe_open(str(run / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def test_blocks_compiled_before_fsdp_keep_the_losses(tmp_path: Path) -> None:
    runs = {}
    # selective checkpointing of 2 blocks: block 0 compiled as it is, block 1 compiled around
    # its checkpointed forward (one run, both kinds of compiled block)
    for name, extra in [("eager", []), ("blocks", ["train.compile=blocks",
                                                   "train.compile_backend=aot_eager",
                                                   "train.activation_checkpointing=selective"])]:
        runs[name] = tmp_path / name
        summary = train(runs[name], *TINY_GPT, *extra, config=str(CONFIGS / "fsdp_gpt.yaml"),
                        nproc=1, timeout=400)
        assert summary["compile"] == ("none" if name == "eager" else "blocks")
    ref = step_losses(runs["eager"])
    assert len(ref) == 6 and ref[-1] < ref[0]
    # traced per block (dynamo + AOTAutograd around FSDP2's hooks), eager's kernels: the same bits
    assert step_losses(runs["blocks"]) == ref
    assert keys(runs["blocks"]) == keys(runs["eager"])  # no _orig_mod. in any name
