"""Where a ResNet-18 step's memory goes: dtlab's `single` run against gpu_baseline's hand loop.

    python benchmarks/resnet_memory.py [--batch 128] [--precision fp32|bf16] [--channels-last]
        [--device cpu|cuda] [--json OUT]

Both sides train configs/ddp_resnet_cifar10.yaml's ResNet-18 on synthetic 32x32 images with the
same batch, precision, layout and SGD, in their own fresh processes, and record one step (the
third) with torch.profiler's memory timeline: PyTorch's split of the live bytes into parameters,
gradients, optimizer state, activations, inputs, temporaries, autograd's own and unknown, at the
step's peak. dtlab records it through `run.profile.memory=true`; the hand loop through the same
analysis (dtlab.instruments.profile_window.timeline_peak). Beside them: each side's peak of the set-up, the
warm-up and the timed steps (dtlab.instruments.metrics.restart_peak: allocated bytes on CUDA, RSS on CPU).
A category that differs is where dtlab's loop holds more than a hand-written one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
CONFIG = "configs/ddp_resnet_cifar10.yaml"
STEPS = 3  # the third is profiled: the first two allocate the optimizer state and the caches


def overrides(args: argparse.Namespace) -> list[str]:
    b = args.batch
    return ["data.name=synthetic", "data.download=false", "data.augment=false",
            "strategy.name=single", f"run.device={args.device}", f"train.global_batch_size={b}",
            f"train.max_steps={STEPS}", f"data.synthetic.train_samples={b * STEPS}",
            f"data.synthetic.val_samples={b}", "train.checkpoint_every=0", "resume=none",
            "run.progress=false", f"train.precision={args.precision}",
            f"model.channels_last={str(args.channels_last).lower()}", "run.timing_warmup_steps=2",
            f"run.threads={args.threads}"]


def dtlab_side(args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "dtlab", "train", "--config", CONFIG, *overrides(args),
           f"run.dir={out}", f"run.profile.start={STEPS}", "run.profile.steps=1",
           "run.profile.memory=true"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    s = json.loads((out / "summary.json").read_text())
    return {**{k: v[0] for k, v in s["memory_per_rank"].items()},
            **{k: s["profile"][k] for k in ("memory_peak_bytes", "memory_peak_by_category")}}


def hand_side(args: argparse.Namespace, out: Path) -> dict:
    """gpu_baseline's hand-written ResNet-18, stepped by hand; run in its own process."""
    from hand_models import hand_model
    from torch.profiler import ProfilerActivity, profile

    from dtlab.config import load_config
    from dtlab.instruments.metrics import peak_memory, restart_peak
    from dtlab.instruments.profile_window import timeline_peak
    from dtlab.levers import numerics

    cfg = load_config(str(ROOT / CONFIG), overrides(args))
    dev, t = torch.device(args.device), cfg.train
    torch.set_num_threads(args.threads)
    numerics.apply(cfg.run, dev)  # cuDNN autotuning and TF32 as dtlab sets them
    torch.manual_seed(cfg.seed)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    model = hand_model(cfg).to(dev, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), t.lr, momentum=t.momentum, nesterov=t.nesterov,
                          weight_decay=t.weight_decay)
    s = cfg.data.synthetic
    batches = [(torch.randn(args.batch, s.in_channels, s.image_size, s.image_size, device=dev)
                .to(memory_format=fmt), torch.randint(0, s.num_classes, (args.batch,), device=dev))
               for _ in range(STEPS)]
    amp = (torch.autocast(dev.type, torch.bfloat16) if args.precision == "bf16"
           else contextlib.nullcontext())
    peaks = restart_peak(dev, "setup")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for step, (x, y) in enumerate(batches, 1):
        window = (profile(activities=activities, profile_memory=True, record_shapes=True,
                          with_stack=True) if step == STEPS else contextlib.nullcontext())
        with window as prof:
            with amp:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 2:
            peaks.update(restart_peak(dev, "warmup"))
    timeline = out / "hand_timeline.json"
    device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    prof.export_memory_timeline(str(timeline), device=device)
    return {**peaks, **peak_memory(dev), **timeline_peak(timeline)}


def mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write both sides' numbers to this file")
    p.add_argument("--hand", help=argparse.SUPPRESS)  # the hand side's output file
    args = p.parse_args(argv)
    if args.hand:
        Path(args.hand).write_text(json.dumps(hand_side(args, Path(args.hand).parent)))
        return 0
    with tempfile.TemporaryDirectory(prefix="resnet_memory-") as tmp:
        sides = {"dtlab": dtlab_side(args, Path(tmp) / "dtlab")}
        hand = Path(tmp) / "hand.json"
        subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--hand", str(hand)],
                       cwd=ROOT, check=True, capture_output=True, text=True)
        sides["hand"] = json.loads(hand.read_text())
    kind = "allocated" if args.device == "cuda" else "rss"
    print(f"ResNet-18, batch {args.batch}, {args.precision}, "
          f"{'channels_last' if args.channels_last else 'NCHW'}, {args.device}: MiB")
    print(f"{'':34} {'dtlab':>10} {'hand':>10} {'dtlab-hand':>11}")
    cats = sides["dtlab"]["memory_peak_by_category"]
    rows = [(f"step {STEPS} peak: {c}", sides["dtlab"]["memory_peak_by_category"][c],
             sides["hand"]["memory_peak_by_category"].get(c, 0)) for c in cats]
    rows.append((f"step {STEPS} peak: total", sides["dtlab"]["memory_peak_bytes"],
                 sides["hand"]["memory_peak_bytes"]))
    rows += [(f"{phase or 'timed steps'} peak {kind}".replace("_ ", " "),
              sides["dtlab"].get(f"{phase}peak_{kind}_bytes"),
              sides["hand"].get(f"{phase}peak_{kind}_bytes")) for phase in ("setup_", "warmup_", "")]
    for name, a, b in rows:
        diff = f"{(a - b) / 2**20:+,.1f}" if a is not None and b is not None else ""
        print(f"{name:34} {mib(a):>10} {mib(b):>10} {diff:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **sides}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
