"""Activation memory: dtlab's estimate against autograd's saved tensors and the measured peak.

    python benchmarks/activation_memory.py [--quick] [--json docs/results/activation_memory.json]
    python benchmarks/activation_memory.py --conv-gap   # ResNet: the gap vs its largest weight

The cases run one after another in a single-threaded child process started with
MALLOC_MMAP_THRESHOLD_=65536, so glibc returns freed blocks to the system and the resident-memory
peak follows the live tensors. Measured = median peak growth of 3 forward + backward steps
(gradients already allocated; `peak_growth`: VmHWM reset through /proc/self/clear_refs). CUDA is
used when available (max_memory_allocated growth). Traced = `saved_bytes`, the distinct new
storages autograd keeps for backward, what activations.py's `saved` counts
(tests/test_estimate.py imports it from here and compares them exactly).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from dtlab.levers import activation_checkpoint
from dtlab.models import loss_fn

CASES = [
    # (label, overrides, micro batches)
    ("quick CNN", ["model.name=cnn"], [32, 256]),
    ("ResNet-18 w0.5", ["model.name=resnet", "model.width=0.5"], [8, 32]),
    ("GPT 4x128 (fsdp_gpt)", ["model.name=gpt"], [8, 32]),
    ("GPT 8x256", ["model.name=gpt", "model.n_layer=8", "model.n_embd=256", "model.n_head=8",
                   "model.block_size=128"], [4, 16]),
]
QUICK = [("quick CNN", ["model.name=cnn"], [128]), ("GPT 4x128 (fsdp_gpt)", ["model.name=gpt"], [32])]
MODES = ["fp32", "autocast"]


def precision_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    autocast = mode == "autocast"
    return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def checkpoint_blocks(model: nn.Module) -> None:
    """Per-block activation checkpointing (non-reentrant), as train.activation_checkpointing=full."""
    activation_checkpoint.apply(model, "full")


def saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> int:
    """Bytes autograd keeps for backward after one forward (distinct storages, new memory only)."""
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()
    skip = {key(t) for t in (*model.parameters(), *model.buffers(), x, y)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if key(t) not in skip:
            kept[key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            precision_context(mode, x.device):
        loss_fn(model(x), y)
    return sum(kept.values())


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def peak_growth(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str,
                repeats: int = 3) -> list[int]:
    """Peak memory growth (bytes) of forward + backward, `repeats` times after two warm-ups."""
    dev = x.device

    def step() -> None:
        with precision_context(mode, dev):
            loss = loss_fn(model(x), y)
        loss.backward()

    for _ in range(2):  # allocates the gradients, initialises kernels and their workspaces
        step()
    out = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=False)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            torch.cuda.synchronize(dev)
            out.append(torch.cuda.max_memory_allocated(dev) - base)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            base = _status("VmRSS")
            step()
            out.append(_status("VmHWM") - base)
    return out


def one(overrides: list[str], micro: int, mode: str, ckpt: bool) -> dict:
    """Runs in the child process: estimate, trace and measure one case."""
    from dtlab.config import load_config
    from dtlab.data import spec_for
    from dtlab.estimate.activations import config_segments, walk
    from dtlab.estimate.measure import batch
    from dtlab.models import build_model

    torch.set_num_threads(1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, overrides)
    spec = spec_for(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, spec).to(dev)
    x, y = batch(spec, micro, dev)
    traced = saved_bytes(model, x, y, mode)
    if ckpt:
        checkpoint_blocks(model)
    est = walk(config_segments(cfg, micro, mode), ckpt)
    grown = peak_growth(model, x, y, mode)
    return {"device": dev.type, "saved_est": est.saved, "peak_est": est.peak,
            "saved_traced": traced, "measured": statistics.median(grown), "runs": grown}


def conv_gap() -> None:
    """ResNet-18 at three widths: measured minus estimated peak, against the largest conv weight."""
    from dtlab.config import load_config

    print(f"{'width':>6}{'micro':>6}{'peak est MB':>12}{'measured MB':>12}{'gap MB':>8}"
          f"{'largest conv weight MB':>24}")
    for width in (0.25, 0.5, 1.0):
        overrides = ["model.name=resnet", f"model.width={width}"]
        cfg = load_config(None, overrides)
        largest = 4 * 9 * round(512 * cfg.model.width) ** 2
        for micro in (4, 16):
            r = one(overrides, micro, "fp32", False)
            print(f"{width:>6}{micro:>6}{r['peak_est'] / 1e6:>12.2f}{r['measured'] / 1e6:>12.2f}"
                  f"{(r['measured'] - r['peak_est']) / 1e6:>8.2f}{largest / 1e6:>24.2f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two cases only")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--conv-gap", action="store_true", help="ResNet's gap vs its largest weight")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "conv-gap":
        conv_gap()
        return 0
    if args.child:
        for label, overrides, micros in QUICK if args.child == "quick" else CASES:
            for micro in micros:
                for mode in MODES:
                    for ckpt in (False, True):
                        r = {"model": label, "overrides": overrides, "micro": micro,
                             "precision": mode, "checkpointing": ckpt,
                             **one(overrides, micro, mode, ckpt)}
                        print(json.dumps(r), flush=True)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    if args.conv_gap:
        return subprocess.run([sys.executable, __file__, "--child", "conv-gap"], env=env).returncode
    child = subprocess.Popen([sys.executable, __file__, "--child", "quick" if args.quick else "all"],
                             env=env, stdout=subprocess.PIPE, text=True)
    rows = []
    print(f"{'model':<22}{'micro':>6}{'precision':>10}{'ckpt':>6}{'saved est MB':>13}"
          f"{'traced MB':>11}{'peak est MB':>12}{'measured MB':>12}{'error':>8}")
    assert child.stdout is not None
    for line in child.stdout:
        r = json.loads(line)
        r["error"] = r["peak_est"] / r["measured"] - 1
        rows.append(r)
        print(f"{r['model']:<22}{r['micro']:>6}{r['precision']:>10}"
              f"{'on' if r['checkpointing'] else 'off':>6}{r['saved_est'] / 1e6:>13.2f}"
              f"{r['saved_traced'] / 1e6:>11.2f}{r['peak_est'] / 1e6:>12.2f}"
              f"{r['measured'] / 1e6:>12.2f}{100 * r['error']:>7.1f}%", flush=True)
    if child.wait():
        return child.returncode
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
