"""The gradient norm from local shards (dtlab/strategies/grad_norm.py) equals torch's DTensor
computation, and clips the same, for FSDP2 (Shard), TP (Shard and Replicate) and HSDP (a 2-D
mesh, Replicate x Shard), on 2 gloo ranks."""

from __future__ import annotations

import ranks
import torch
import torch.distributed as dist
from torch import nn

REL = 1e-6  # float32 sums in another order


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _trained(layout: str) -> nn.Module:
    """The model laid out as `layout`, with the gradients of one batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model()
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard")))
    else:
        parallelize_module(model, init_device_mesh("cpu", (2,)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # data parallel: another batch per rank; tensor parallel: the same batch on every rank
    torch.manual_seed(1 + (dist.get_rank() if layout != "tp" else 0))
    model(torch.randn(4, 16)).square().sum().backward()
    return model


def _check(argv: list[str]) -> int:
    from torch.distributed.tensor import DTensor

    from dtlab.strategies import grad_norm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    failures = []
    for layout in argv:
        model = _trained(layout)
        grads = [p.grad for p in model.parameters()]
        assert grad_norm.local_layout(grads), layout
        ref = torch.nn.utils.get_total_norm(grads).full_tensor()
        got = grad_norm.total_norm(grads)
        assert not isinstance(got, DTensor) and got.dtype == torch.float32
        ours = [g.detach().clone() for g in grads]
        grad_norm.clip_(ours, 0.1 * ref.item(), got)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1 * ref.item(), ref)
        worst = max(((a.full_tensor() - b.full_tensor()).abs().max() / b.full_tensor().abs().max()).item()
                    for a, b in zip(ours, grads, strict=True))
        if abs(got.item() - ref.item()) > REL * ref.item() or worst > REL:
            failures.append(f"{layout}: norm {got.item()} vs {ref.item()}, clipped {worst:.2e}")
        elif dist.get_rank() == 0:
            print(f"{layout} {got.item():.6f}", flush=True)
    dist.destroy_process_group()
    print(*failures, sep="\n", flush=True)
    return 1 if failures else 0


def test_local_shards_give_torchs_norm_and_clipping() -> None:
    proc = ranks.start(2, ["fsdp", "tp", "hsdp"], target=_check, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = dict(line.split() for line in proc.stdout.split("\n") if line.strip())
    assert set(lines) == {"fsdp", "tp", "hsdp"}, proc.stdout
