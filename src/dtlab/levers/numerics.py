"""How a rank computes: TF32 matmuls, cuDNN autotuning and deterministic algorithms (`run.tf32`,
`run.cudnn_benchmark`, `run.deterministic`), set once per rank before the model is built.

Deterministic mode makes two runs of the same command produce the same bits on a GPU, which
`dtlab compare --verify` needs to check bf16 CUDA runs step for step: torch's deterministic
algorithms (an op without one raises instead of running nondeterministically), cuBLAS with a
fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when the first cuBLAS handle is made, so it is set
here, before any matmul), cuDNN without autotuning, and attention on the math kernel only (the
flash and memory-efficient kernels accumulate their backward with atomics). It costs speed and,
for attention, memory: the math kernel materialises the attention matrix. On CPU, dtlab's
kernels are deterministic already; the mode changes nothing there but is checked to keep the
losses.
"""

from __future__ import annotations

import os
from typing import Any

import torch

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for reproducible results


def settings(run: Any, device: torch.device) -> dict[str, Any]:
    """What `apply` sets, resolved from the run config (summary.json records it)."""
    cuda = device.type == "cuda"
    bench = run.cudnn_benchmark
    return {"deterministic": run.deterministic, "tf32": run.tf32,
            "cudnn_benchmark": (cuda and not run.deterministic) if bench == "auto" else bench}


def apply(run: Any, device: torch.device) -> dict[str, Any]:
    """Set this process's numerics from the run config; returns `settings`."""
    chosen = settings(run, device)
    torch.backends.cuda.matmul.allow_tf32 = chosen["tf32"]
    torch.backends.cudnn.allow_tf32 = chosen["tf32"]
    torch.backends.cudnn.benchmark = chosen["cudnn_benchmark"]
    if chosen["deterministic"]:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return chosen
