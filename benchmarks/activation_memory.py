"""Activation memory: dtlab's estimate against autograd's saved tensors and the measured peak.

    python benchmarks/activation_memory.py [--quick] [--json docs/results/activation_memory.json]

Each case runs in a fresh single-threaded process with MALLOC_MMAP_THRESHOLD_=65536, so glibc
returns freed blocks to the system and the resident-memory peak follows the live tensors
(src/dtlab/estimate/measure.py). Measured = median peak growth of 3 forward + backward steps
(gradients already allocated). CUDA is used when available (max_memory_allocated growth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [
    # (label, overrides, micro batches)
    ("quick CNN", ["model.name=cnn"], [32, 128, 512]),
    ("ResNet-18 w0.5", ["model.name=resnet", "model.width=0.5"], [8, 32]),
    ("GPT 4x128 (fsdp_gpt)", ["model.name=gpt"], [8, 32, 64]),
    ("GPT 8x256", ["model.name=gpt", "model.n_layer=8", "model.n_embd=256", "model.n_head=8",
                   "model.block_size=128"], [4, 16]),
]
QUICK = [("quick CNN", ["model.name=cnn"], [128]), ("GPT 4x128 (fsdp_gpt)", ["model.name=gpt"], [32])]
MODES = ["fp32", "autocast"]


def one(overrides: list[str], micro: int, mode: str, ckpt: bool) -> dict:
    """Runs in the child process: estimate, trace and measure one case."""
    import torch

    from dtlab.config import load_config
    from dtlab.data import spec_for
    from dtlab.estimate.activations import config_segments, walk
    from dtlab.estimate.measure import batch, checkpoint_blocks, peak_growth, saved_bytes
    from dtlab.models import build_model

    torch.set_num_threads(1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, overrides)
    spec = spec_for(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, spec).to(dev)
    x, y = batch(cfg.model.name, spec, micro, dev)
    traced = saved_bytes(model, x, y, mode)
    if ckpt:
        checkpoint_blocks(model)
    est = walk(config_segments(cfg, micro, mode), ckpt)
    grown = peak_growth(model, x, y, mode)
    return {"device": dev.type, "saved_est": est.saved, "peak_est": est.peak,
            "saved_traced": traced, "measured": statistics.median(grown), "runs": grown}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two cases only")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one(**json.loads(args.child))))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows = []
    print(f"{'model':<22}{'micro':>6}{'precision':>10}{'ckpt':>6}{'saved est MB':>13}"
          f"{'traced MB':>11}{'peak est MB':>12}{'measured MB':>12}{'error':>8}")
    for label, overrides, micros in QUICK if args.quick else CASES:
        for micro in micros:
            for mode in MODES:
                for ckpt in (False, True):
                    spec = json.dumps({"overrides": overrides, "micro": micro, "mode": mode,
                                       "ckpt": ckpt})
                    out = subprocess.run([sys.executable, __file__, "--child", spec], env=env,
                                         capture_output=True, text=True, check=True)
                    r = {"model": label, "overrides": overrides, "micro": micro,
                         "precision": mode, "checkpointing": ckpt,
                         **json.loads(out.stdout.splitlines()[-1])}
                    r["error"] = r["peak_est"] / r["measured"] - 1
                    rows.append(r)
                    print(f"{label:<22}{micro:>6}{mode:>10}{'on' if ckpt else 'off':>6}"
                          f"{r['saved_est'] / 1e6:>13.2f}{r['saved_traced'] / 1e6:>11.2f}"
                          f"{r['peak_est'] / 1e6:>12.2f}{r['measured'] / 1e6:>12.2f}"
                          f"{100 * r['error']:>7.1f}%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
