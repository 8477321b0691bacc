"""dtlab's training loop against minimal hand-written loops: the same model, batch and steps.

    python benchmarks/gpu_baseline.py [--workloads gpt,resnet] [--modes eager,compiled]
        [--repeats 3] [--steps 40] [--warmup 10] [--json OUT]
    python benchmarks/gpu_baseline.py --smoke    # tiny sizes, CPU, eager: a check of the script

Workloads: `gpt` is configs/fsdp_gpt.yaml at 12 x 768, sequence 1024, vocabulary 50304, batch 16;
`resnet` is configs/ddp_resnet_cifar10.yaml (ResNet-18, 32x32, SGD) at batch 512 on synthetic
images. dtlab runs `python -m dtlab train strategy.name=single ...` and its summary.json is read;
the hand loop is this file (`--hand gpt|resnet`), a nanoGPT-style loop with its own models
(hand_models.py: a GPT with one fused qkv projection, scaled_dot_product_attention and GELU MLPs,
and a CIFAR ResNet-18), each with exactly dtlab's parameter count (printed), and the best
practices a careful user would apply: fused AdamW/SGD, TF32 matmuls, cudnn.benchmark and
channels_last for the ResNet, set_to_none gradients, no host synchronisation inside the step but
the timing one.

What is the same on both sides (fairness): the model (architecture, parameter count, init scale),
batch, optimizer and its hyperparameters, LR schedule and gradient clipping, all read from the same
config; bf16 autocast on CUDA, fp32 and one thread on CPU; torch.compile of the model (not the
optimizer) in the compiled mode; data generated on the device before training (dtlab's synthetic
data, random tensors here), as many samples as the run uses; each side in its own fresh process;
the timing rule: wall time of each step up to a device synchronisation, the first --warmup steps
excluded, the median of the rest; MFU = model FLOPs (dtlab.instruments.flops.count) / median step / dtlab's
peak for the device; peak memory = dtlab.instruments.metrics' peak over the timed steps (CUDA: max allocated;
CPU: peak RSS), the set-up's and the warm-up's printed beside it. What differs is
what is measured: dtlab's loop and its bookkeeping (strategy and step engine, the finiteness check
of the gradient norm, the scheduler) against the few lines of `hand_run`. Pairs alternate which
side runs first; the table gives dtlab's speed / the hand loop's, median over repeats [min-max]
(>= 1.00: dtlab is at least as fast). --smoke is a ~1 minute check of the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hand_models import hand_model  # beside this file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "compiled")
# workload -> (config, overrides at benchmark size, overrides for --smoke)
WORKLOADS: dict[str, tuple[str, list[str], list[str]]] = {
    "gpt": ("configs/fsdp_gpt.yaml",
            ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
             "model.vocab_size=50304", "train.global_batch_size=16"],
            ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=32",
             "model.vocab_size=128", "train.global_batch_size=4"]),
    "resnet": ("configs/ddp_resnet_cifar10.yaml",
               ["data.name=synthetic", "data.download=false", "data.augment=false",
                "train.global_batch_size=512"],
               ["data.name=synthetic", "data.download=false", "data.augment=false",
                "train.global_batch_size=8"]),
}


def size(workload: str, smoke: bool, key: str, default: int = 1) -> int:
    """A number among a workload's size overrides (`key`: e.g. train.global_batch_size)."""
    found = dict(o.split("=") for o in WORKLOADS[workload][2 if smoke else 1])
    return int(found.get(key, default))


def overrides(workload: str, smoke: bool, steps: int, warmup: int, device: str) -> list[str]:
    """The dtlab overrides both sides read: sizes, steps, precision, one epoch of data."""
    batch, total = size(workload, smoke, "train.global_batch_size"), warmup + steps
    return [*WORKLOADS[workload][2 if smoke else 1], "strategy.name=single",
            f"run.device={device}", f"train.max_steps={total}", "train.checkpoint_every=0",
            f"data.synthetic.train_samples={batch * total}", f"data.synthetic.val_samples={batch}",
            f"run.timing_warmup_steps={warmup}", f"run.log_every={total}", "run.progress=false",
            "resume=none", f"train.precision={'bf16' if device == 'cuda' else 'fp32'}",
            # CPU: one thread each, the least disturbed by whatever else shares the cores
            *(["run.threads=1"] if device == "cpu" else [])]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


# ------------------------------------------------------------------------------- hand loop
def hand_run(workload: str, compiled: bool, args: argparse.Namespace) -> dict[str, Any]:
    from dtlab.config import load_config
    from dtlab.data import spec_for
    from dtlab.instruments.flops import count
    from dtlab.instruments.metrics import peak_memory, restart_peak
    from dtlab.models import build_model, count_params

    cfg = load_config(str(ROOT / WORKLOADS[workload][0]),
                      overrides(workload, args.smoke, args.steps, args.warmup, args.device))
    t, b, total = cfg.train, cfg.train.global_batch_size, args.warmup + args.steps
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(cfg.seed)
    model = hand_model(cfg).to(dev)
    if cfg.model.name == "gpt":
        seq = torch.randint(0, cfg.model.vocab_size, (total, b, cfg.model.block_size + 1),
                            device=dev)
        batches = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seq]
    else:
        fmt = torch.channels_last if cuda else torch.contiguous_format
        model = model.to(memory_format=fmt)
        s = cfg.data.synthetic
        shape = (b, s.in_channels, s.image_size, s.image_size)
        batches = [(torch.empty(shape, device=dev, memory_format=fmt).normal_(),
                    torch.randint(0, s.num_classes, (b,), device=dev)) for _ in range(total)]
    lr = t.lr * (b / t.lr_scale_base_batch if t.lr_scale_base_batch else 1.0)
    opt = (torch.optim.AdamW(model.parameters(), lr, betas=t.betas, weight_decay=t.weight_decay,
                             fused=True) if t.optimizer == "adamw" else
           torch.optim.SGD(model.parameters(), lr, momentum=t.momentum, nesterov=t.nesterov,
                           weight_decay=t.weight_decay, fused=True))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine to min_lr_ratio
        if step < t.warmup_steps:
            return lr * (step + 1) / t.warmup_steps
        done = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
        return lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))

    if compiled:
        # dtlab's inductor cache: a later process of either side reuses the other's kernels
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache/dtlab/inductor"))
    forward = torch.compile(model) if compiled else model
    amp = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.train()
    times, peaks = [], restart_peak(dev, "setup")
    for step in range(total):
        t0 = time.perf_counter()
        x, y = batches[step]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with amp:
            logits = forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if t.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        if step + 1 == args.warmup:
            peaks.update(restart_peak(dev, "warmup"))
    median = statistics.median(times[args.warmup:])
    spec = spec_for(cfg)
    flops = count(cfg, spec, b)[0]  # dtlab's count: the same model, the same FLOPs
    with torch.device("meta"):
        dtlab_params = count_params(build_model(cfg.model, spec))
    return {"median_step_time_s": median, "step_times_s": times, "n_params": n_params(model),
            "dtlab_n_params": dtlab_params, "final_loss": loss.item(), "flops_per_step": flops,
            "tflops": flops / median / 1e12,
            **peak_bytes({**peaks, **peak_memory(dev)})}


# ----------------------------------------------------------------------------------- driver
def peak_bytes(memory: dict[str, int]) -> dict[str, int | None]:
    """peak, setup_peak and warmup_peak bytes: allocated on CUDA, RSS on CPU."""
    kind = "allocated" if "peak_allocated_bytes" in memory else "rss"
    return {f"{phase}peak_bytes": memory.get(f"{phase}peak_{kind}_bytes")
            for phase in ("", "setup_", "warmup_")}


def run_side(side: str, workload: str, compiled: bool, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """One fresh process of `side` (dtlab or hand); its median step and what it measured."""
    out = Path(tempfile.mkdtemp(prefix=f"{side}-{workload}-", dir=tmp))
    if side == "dtlab":
        cmd = [sys.executable, "-m", "dtlab", "train", "--config", WORKLOADS[workload][0],
               *overrides(workload, args.smoke, args.steps, args.warmup, args.device),
               f"train.compile={str(compiled).lower()}", f"run.dir={out}"]
    else:
        cmd = [sys.executable, __file__, "--hand", workload, "--out", str(out / "hand.json"),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
               *(["--compile"] if compiled else []), *(["--smoke"] if args.smoke else [])]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"gpu_baseline: the {side} run of {workload} took over 900 s: "
                         f"{' '.join(cmd)}") from None
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"gpu_baseline: the {side} run of {workload} failed "
                         f"(exit {proc.returncode}): {tail}\n  command: {' '.join(cmd)}")
    if side == "hand":
        return json.loads((out / "hand.json").read_text())
    s = json.loads((out / "summary.json").read_text())
    return {"median_step_time_s": s["median_step_time_s"], "n_params": s["n_params"],
            "final_loss": s["final_train_loss"], "flops_per_step": s.get("flops_per_step"),
            "tflops": s.get("tflops_per_rank"), "mfu": s.get("mfu"),
            "peak_tflops": s.get("peak_tflops"), "mfu_note": s.get("mfu_note"),
            **peak_bytes({k: v[0] for k, v in s["memory_per_rank"].items()}),
            "optimizer_impl": s["optimizer_impl"], "device_name": s["device_name"]}


def run_pair(workload: str, compiled: bool, first: str, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """dtlab and the hand loop, `first` first; the hand loop's MFU against dtlab's peak of the
    same device and precision (on CPU a matmul measured once, in the dtlab run)."""
    pair = {side: run_side(side, workload, compiled, args, tmp)
            for side in (first, "hand" if first == "dtlab" else "dtlab")}
    top = pair["dtlab"]["peak_tflops"]
    pair["hand"]["mfu"] = pair["hand"]["tflops"] / top if top else None
    print(f"  {workload} {'compiled' if compiled else 'eager'}, {first} first: median step "
          + ", ".join(f"{side} {pair[side]['median_step_time_s'] * 1e3:.2f} ms"
                      for side in ("dtlab", "hand")), flush=True)
    return pair


def per_second(workload: str, smoke: bool, median_step: float) -> float:
    """Tokens/s (GPT) or samples/s (ResNet) at this median step time."""
    return (size(workload, smoke, "train.global_batch_size")
            * size(workload, smoke, "model.block_size") / median_step)


def fmt_speed(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def fmt_mem(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def fmt_mfu(pairs: list[dict], side: str) -> str:
    values = [p[side]["mfu"] for p in pairs if p[side].get("mfu") is not None]
    return f"{statistics.median(values):.1%}" if values else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt,resnet")
    p.add_argument("--modes", help="eager,compiled (--smoke: eager)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny, CPU, <= 2 repeats")
    p.add_argument("--json", help="write every measurement to this file")
    p.add_argument("--hand", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hand:  # one hand-loop run, in its own process
        Path(args.out).write_text(json.dumps(hand_run(args.hand, args.compile, args)))
        return 0
    if args.smoke:
        args.device, args.modes, args.steps, args.warmup = "cpu", args.modes or "eager", 3, 2
        args.repeats = min(args.repeats, 2)
    workloads, modes = args.workloads.split(","), (args.modes or ",".join(MODES)).split(",")
    bad = [w for w in workloads if w not in WORKLOADS] + [m for m in modes if m not in MODES]
    if bad:
        print(f"gpu_baseline: error: unknown workload or mode {', '.join(bad)}; fix: choose "
              f"--workloads from {','.join(WORKLOADS)} and --modes from {','.join(MODES)}",
              file=sys.stderr)
        return 2
    if args.device == "cpu":
        print("CPU SMOKE NUMBERS, not the GPU benchmark: fp32 on this CPU, MFU against its "
              "measured float32 matmul; run on a CUDA machine for the real comparison")
    results: dict[str, Any] = {"device": args.device, "steps": args.steps, "warmup": args.warmup,
                               "repeats": args.repeats, "smoke": args.smoke, "runs": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_baseline-") as tmp:
        for workload in workloads:
            for mode in modes:
                pairs = [run_pair(workload, mode == "compiled", ("dtlab", "hand")[r % 2], args,
                                  Path(tmp)) for r in range(args.repeats)]
                results["runs"][f"{workload}/{mode}"] = pairs
                rows.append((workload, mode, pairs))
                if args.json:  # what is measured so far survives a later failure
                    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{args.steps} timed steps after {args.warmup} warm-up, {args.repeats} repeat(s); "
          "speeds are medians over repeats, the ratio is dtlab's speed / the hand loop's")
    print(f"{'workload':8} {'mode':9} {'dtlab':>10} {'hand':>10} {'dtlab/hand [min-max]':>21} "
          f"{'MFU dtlab':>9} {'MFU hand':>8} {'mem dtlab':>10} {'mem hand':>10}")
    for workload, mode, pairs in rows:
        unit = "tok/s" if workload == "gpt" else "samples/s"
        speed = {side: statistics.median(per_second(workload, args.smoke,
                                                    q[side]["median_step_time_s"]) for q in pairs)
                 for side in ("dtlab", "hand")}
        ratios = [q["hand"]["median_step_time_s"] / q["dtlab"]["median_step_time_s"] for q in pairs]
        summary = {"unit": unit, **{f"{k}_per_s": v for k, v in speed.items()},
                   "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                   "ratio_max": max(ratios)}
        results[f"{workload}/{mode}"] = summary
        print(f"{workload:8} {mode:9} {fmt_speed(speed['dtlab']):>10} "
              f"{fmt_speed(speed['hand']):>10} "
              f"{summary['ratio_median']:6.3f}x [{min(ratios):.3f}-{max(ratios):.3f}] "
              f"{fmt_mfu(pairs, 'dtlab'):>9} {fmt_mfu(pairs, 'hand'):>8} "
              f"{fmt_mem(pairs[-1]['dtlab']['peak_bytes']):>10} "
              f"{fmt_mem(pairs[-1]['hand']['peak_bytes']):>10}  ({unit})")
        hand = pairs[0]["hand"]
        print(f"  parameters: dtlab {pairs[0]['dtlab']['n_params']:,}, hand {hand['n_params']:,}"
              + ("" if hand["n_params"] == pairs[0]["dtlab"]["n_params"] else "  MISMATCH"))
        print("  peak memory (" + ("allocated" if args.device == "cuda" else "RSS") + ") of "
              "set-up / warm-up / timed steps: " + "; ".join(
                  f"{side} " + " / ".join(fmt_mem(pairs[-1][side][f"{phase}peak_bytes"])
                                          for phase in ("setup_", "warmup_", ""))
                  for side in ("dtlab", "hand")))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
