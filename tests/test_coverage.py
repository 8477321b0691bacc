"""Exact data coverage across real ranks (gloo process group) on a real-format CIFAR-10 file set.

Each image carries its index in its pixels; the ranks decode what their batches hold after the
reader, the sampler and the normalisation, and gather it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ranks  # noqa: F401  (the forkserver's preload: torch and dtlab imported once)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from formats import decode_ids, write_cifar10

from dtlab.config import load_config
from dtlab.data import EvalLoader, TrainLoader, build_datasets, cifar10
from dtlab.distributed import DistEnv, distributed

WORLD = 2


def pixels(x: torch.Tensor) -> np.ndarray:
    """Undo the normalisation of a CIFAR-10 batch back to uint8 pixels."""
    mean = torch.tensor(cifar10.MEAN).view(1, 3, 1, 1)
    std = torch.tensor(cifar10.STD).view(1, 3, 1, 1)
    return ((x * std + mean) * 255).round().to(torch.uint8).numpy()


def worker(rank: int, root: str, port: int, out: str) -> None:
    env = DistEnv(rank, rank, WORLD, WORLD, "127.0.0.1", port, "torchrun")
    cfg = load_config(None, ["model.name=cnn", "data.name=cifar10", f"data.dir={root}",
                             "strategy.name=ddp", "train.global_batch_size=40",
                             "train.grad_accum_steps=2"])
    with distributed(timeout_s=60, env=env) as ctx:
        train_set, val_set, spec = build_datasets(cfg, ctx)
        assert spec.in_channels == 3 and spec.num_classes == 10
        loader = TrainLoader(train_set, rank, WORLD, micro_batch=10, grad_accum_steps=2, seed=5)
        seen = [decode_ids(pixels(train_set.batch(micro)[0])) for step in loader.epoch_indices(0)
                for micro in step]
        val_seen = [decode_ids(pixels(x)[mask.bool().numpy()]) for x, _, mask in
                    EvalLoader(val_set, rank, WORLD, batch_size=8)]
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, (seen, val_seen))
        if rank == 0:
            torch.save(gathered, out)


def test_one_epoch_covers_the_dataset_exactly(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_file=40, test=30)  # 200 training images, 5 steps of 40
    out = tmp_path / "seen.pt"
    mp.start_processes(worker, args=(str(tmp_path), free_port(), str(out)), nprocs=WORLD,
                       join=True, start_method="forkserver")
    gathered = torch.load(out, weights_only=True)
    train_ids = [i for seen, _ in gathered for batch in seen for i in batch]
    assert sorted(train_ids) == list(range(200))  # every sample once, none twice
    for seen, _ in gathered:  # each rank: 5 steps x 2 micro batches x 10 samples
        assert len(seen) == 10 and all(len(b) == 10 for b in seen)
    val_ids = [i for _, val_seen in gathered for batch in val_seen for i in batch]
    assert sorted(val_ids) == list(range(10_000, 10_030))
