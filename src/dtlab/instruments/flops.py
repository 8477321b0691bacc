"""FLOPs per step, achieved TFLOP/s and MFU.

A step's FLOPs are counted once per run with torch's FlopCounterMode on a copy of the model on
the meta device (shapes only, nothing computed): forward + backward of the global batch. "Model"
FLOPs are the model's own; "hardware" FLOPs add what activation checkpointing recomputes. MFU is
model FLOPs per second per rank over the rank's peak: from PEAK_TFLOPS by device name and
precision, or `run.peak_tflops`; an unknown device gets no MFU, said in `mfu_note`, never a
guess. On CPU there is no datasheet peak: the peak is a float32 matrix multiplication measured
before the first step with the rank's threads (machine_load.LoadProbe; the note says so), so "MFU"
reads as the fraction of what this machine's matmul reaches.

An MFU is a result only when it can be true: above 100% the peak is wrong (a user-set peak too
low, a CPU probe slowed by other processes), and a CPU peak measured on a loaded machine is not
this machine's peak. Then `mfu` is null and `mfu_note` says why ("withheld: ...").
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from dtlab.levers import activation_checkpoint
from dtlab.models import build_model, loss_fn

# Dense (no sparsity) peak TFLOP/s per GPU from the vendors' datasheets: (16-bit, fp32 without
# TF32). NVIDIA H100 SXM5 / PCIe and H200 SXM: H100/H200 datasheets; A100 SXM4 80GB: A100
# datasheet; L40S, L4: their product briefs. Matched by substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.4, 66.9),  # SXM5 (also "H100 80GB HBM3")
    "H200": (989.4, 66.9),
    "A100": (312.0, 19.5),
    "L40S": (362.05, 91.6),
    "L4": (121.0, 30.3),
}


def count(cfg: Any, spec: Any, batch: int) -> tuple[float, float]:
    """(model, hardware) FLOPs of one forward + backward of `batch` samples."""
    flops: list[float] = []
    modes = dict.fromkeys(("none", cfg.train.activation_checkpointing))  # once without recompute
    for mode in modes:
        with torch.device("meta"):
            model = build_model(cfg.model, spec, cfg.train.lora)
            activation_checkpoint.apply(model, mode, cfg.train.ac_every)
            if spec.kind == "tokens":
                x = y = torch.randint(0, spec.vocab_size, (batch, spec.seq_len))
            else:
                x = torch.randn(batch, spec.in_channels, spec.image_size, spec.image_size)
                y = torch.randint(0, spec.num_classes, (batch,))
        with FlopCounterMode(display=False) as counter:
            loss_fn(model(x), y).backward()
        flops.append(float(counter.get_total_flops()))
    return flops[0], flops[-1]


def cpu_matmul_tflops(threads: int, n: int = 512, repeats: int = 10) -> float:
    """The best of `repeats` float32 n x n matrix multiplications, in TFLOP/s."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = min(_timed(a, b) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e12


def _timed(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    a @ b
    return time.perf_counter() - t0


def peak(device: torch.device, device_name: str, precision: str, threads: int,
         override: float | None, measured: float | None = None) -> tuple[float | None, str]:
    """Peak TFLOP/s of one rank and where it comes from (`measured`: the CPU probe taken before
    the run; without it the probe runs now, after the run, and the note says so)."""
    if override:
        return override, "run.peak_tflops"
    if device.type == "cpu":
        when = "before the first step" if measured else "after the run"
        top = measured or cpu_matmul_tflops(threads)
        return top, f"float32 matmul measured on this CPU {when} with {threads} thread(s)"
    for name, (half, fp32) in PEAK_TFLOPS.items():
        if name in device_name:
            return (fp32 if precision == "fp32" else half), f"{name} datasheet, {precision} dense"
    return None, f"unknown device '{device_name}': MFU not reported; set run.peak_tflops"


def utilization(cfg: Any, spec: Any, device: torch.device, device_name: str, threads: int,
                world_size: int, step_time_s: float | None, measured_peak: float | None = None,
                unreliable: list[str] | None = None) -> dict[str, Any]:
    """summary.json's FLOP fields for a median step of `step_time_s` (rank 0 writes them: the
    other ranks skip the count, ~0.2 s of Python for a small GPT). `unreliable`: why the run's
    timings cannot be trusted (machine_load.judge)."""
    model_flops, hw_flops = count(cfg, spec, cfg.train.global_batch_size)
    out: dict[str, Any] = {"flops_per_step": model_flops, "hardware_flops_per_step": hw_flops}
    if not step_time_s or step_time_s <= 0:
        return out
    per_rank = model_flops / world_size / step_time_s / 1e12
    top, source = peak(device, device_name, cfg.train.precision, threads, cfg.run.peak_tflops,
                       measured_peak)
    out |= {"tflops_per_rank": per_rank,
            "hardware_tflops_per_rank": hw_flops / world_size / step_time_s / 1e12,
            "peak_tflops": top, **mfu(per_rank, top, source, device.type == "cpu" and
                                      not cfg.run.peak_tflops, unreliable or [])}
    return out


def mfu(per_rank: float, top: float | None, source: str, probed: bool,
        unreliable: list[str]) -> dict[str, Any]:
    """{"mfu", "mfu_note"}: the fraction of the peak, or None and why it is withheld."""
    if not top:
        return {"mfu": None, "mfu_note": source}
    fraction = per_rank / top
    if fraction > 1:
        fix = ("rerun on an idle machine, or set run.peak_tflops" if probed else
               "set run.peak_tflops to the device's peak TFLOP/s")
        return {"mfu": None, "mfu_note": f"withheld: the steps reached {per_rank:.3g} TFLOP/s per "
                f"rank, {100 * fraction:.0f}% of the peak of {top:.3g} TFLOP/s ({source}), so "
                f"that peak is wrong; fix: {fix}"}
    if probed and unreliable:  # the probe and the steps shared the cores with other work
        return {"mfu": None, "mfu_note": f"withheld: the peak was measured on this CPU while "
                f"its timings were unreliable ({'; '.join(unreliable)}); fix: rerun on an idle "
                "machine, or set run.peak_tflops"}
    return {"mfu": fraction, "mfu_note": source}
