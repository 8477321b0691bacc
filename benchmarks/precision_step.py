"""Where a bf16 training step spends its time: autocast vs a bf16 model vs FSDP2's mixed precision.

    python benchmarks/precision_step.py [--quick] [--profile] [--json FILE]

One process, one device (CUDA when available), dtlab's GPT (default 12 x 768, sequence 1024,
micro batch 16; --quick: 2 x 64 on 64 tokens), AdamW. Each mode times `--steps` forward + backward +
optimizer steps after 5 warm-ups (median, CUDA-synchronised):
  fp32              the model in fp32
  autocast          fp32 weights, torch.autocast(bf16): what `single`/`ddp` do with train.precision=bf16
  bf16-weights      the model cast to bf16, no autocast: what FSDP's param_dtype=bf16 computes with
  fsdp2-fp32        fully_shard per block + root on a 1-rank mesh
  fsdp2-bf16        the same with MixedPrecisionPolicy(bf16, reduce fp32): `fsdp` with bf16
--profile prints the 8 kernels that take most device time in each mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from dtlab.config.strategies.fsdp_spec import FSDPOptions
from dtlab.models.gpt import GPT
from dtlab.strategies.base import autocast
from dtlab.strategies.fsdp import shard

MODES = ["fp32", "autocast", "bf16-weights", "fsdp2-fp32", "fsdp2-bf16"]


def build(mode: str, shape: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(**shape).to(device)
    if mode == "bf16-weights":
        model = model.to(torch.bfloat16)
    if mode.startswith("fsdp2"):  # exactly what strategy fsdp applies (default options)
        mesh = init_device_mesh(device.type, (1,))
        shard(model, mesh, FSDPOptions(), "bf16" if mode == "fsdp2-bf16" else "fp32", device)
    return model


def timed_steps(mode: str, shape: dict, micro: int, steps: int, device: torch.device,
                profile: bool) -> dict:
    model = build(mode, shape, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, shape["vocab_size"], (micro, shape["block_size"]), device=device)
    y = torch.roll(x, -1, dims=1)
    precision = "bf16" if mode == "autocast" else "fp32"  # fp32: no autocast

    def step() -> None:
        with autocast(precision, device):  # the helper the strategies use
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    row = {"mode": mode, "step_ms": 1000 * statistics.median(times)}
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    if profile:
        with torch.profiler.profile() as prof:
            for _ in range(3):
                step()
            sync()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        row["top_kernels"] = prof.key_averages().table(sort_by=key, row_limit=8)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shape = (dict(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256) if a.quick else
             dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=256))
    micro = 4 if a.quick else 16
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    try:
        rows = [timed_steps(m, shape, micro, a.steps, device, a.profile) for m in MODES]
    finally:
        dist.destroy_process_group()
    print(f"{'mode':14} {'step ms':>8} {'peak MiB':>9}   ({device.type}, micro batch {micro}, {shape})")
    for r in rows:
        print(f"{r['mode']:14} {r['step_ms']:8.2f} {r.get('peak_mib', float('nan')):9.1f}")
    for r in rows:
        if "top_kernels" in r:
            print(f"\n== {r['mode']}\n{r['top_kernels']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "shape": shape, "micro_batch": micro,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
