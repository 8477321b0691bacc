"""Datasets: synthetic (on the device), CIFAR-10 (binary), MNIST (IDX) and token files.

`build_datasets` prepares the files on one rank per node (downloading if allowed) while the others
wait, then every rank loads them. Real image datasets are held as uint8 on the training device and
normalised per batch there.

Beside the levers, under the models: may import config, process control and the ground; never
models, strategies or anything above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dtlab import files
from dtlab.config import LANGUAGE_MODELS, Config
from dtlab.data import cifar10, mnist, tokens
from dtlab.data.arrays import ArrayDataset, TokenWindows, augmenter, normalizer
from dtlab.data.loader import Dataset, EvalLoader, SampleUsage, TrainLoader
from dtlab.data.synthetic import synthetic_images, synthetic_tokens
from dtlab.distributed import DistContext
from dtlab.errors import DataError, PeerError

__all__ = [
    "DataSpec", "Dataset", "EvalLoader", "SampleUsage", "TrainLoader", "build_datasets",
    "check_data_dir", "spec_for",
]


@dataclass(frozen=True)
class DataSpec:
    """What the model must accept: images (channels, size, classes) or token sequences."""

    kind: str  # "image" | "tokens"
    in_channels: int = 0
    image_size: int = 0
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0


IMAGE_SETS = {"cifar10": (cifar10, (3, 32)), "mnist": (mnist, (1, 28))}


def spec_for(cfg: Config) -> DataSpec:
    """What the model must accept, from the config alone (no data is read)."""
    if cfg.model.name in LANGUAGE_MODELS:
        return DataSpec("tokens", vocab_size=cfg.model.vocab_size, seq_len=cfg.model.block_size)
    if cfg.data.name == "synthetic":
        s = cfg.data.synthetic
        return DataSpec("image", s.in_channels, s.image_size, s.num_classes)
    channels, size = IMAGE_SETS[cfg.data.name][1]
    return DataSpec("image", channels, size, 10)


def check_data_dir(cfg: Config) -> None:
    """Before any rank starts (one message, not one per rank): data.dir can be a directory, and
    a token data set's files are there and are the ones its meta.json describes."""
    d = cfg.data
    if d.name == "synthetic":
        return
    problem = files.not_a_directory(Path(d.dir), "data.dir")
    if problem:
        raise DataError(problem)
    if cfg.model.name in LANGUAGE_MODELS:
        tokens.check_dataset(Path(d.dir))


def _limit(ds: ArrayDataset, n: int) -> ArrayDataset:
    return ArrayDataset(ds.inputs[:n], ds.targets[:n], ds.transform) if n else ds


def _prepare_files(cfg: Config, ctx: DistContext) -> None:
    """Download/verify on local rank 0 of each node; all ranks learn whether it worked."""
    error: DataError | None = None
    if ctx.env.local_rank == 0:
        module, _ = IMAGE_SETS[cfg.data.name]
        try:
            module.prepare(Path(cfg.data.dir), cfg.data.download)
        except DataError as e:
            error = e
    ok = torch.tensor([0.0 if error else 1.0], device=ctx.device)
    ctx.all_reduce_sum(ok)  # a sum below world size: some node failed; nobody waits forever
    if error:
        raise error
    if ok.item() < ctx.world_size:
        raise PeerError("preparing the dataset failed on another node")


def build_datasets(cfg: Config, ctx: DistContext) -> tuple[Dataset, Dataset, DataSpec]:
    d, dev = cfg.data, ctx.device
    spec = spec_for(cfg)
    if cfg.model.name in LANGUAGE_MODELS:
        m = cfg.model
        if d.name == "synthetic":
            train, val = synthetic_tokens(d.synthetic, cfg.seed, m.vocab_size, m.block_size, dev)
            return _limit(train, d.train_limit), _limit(val, d.val_limit), spec
        splits = (tokens.open_split(Path(d.dir), s, m.vocab_size, m.block_size, m.VOCAB_KEY)
                  for s in ("train", "val"))
        train, val = (TokenWindows(split, m.block_size, dev) for split in splits)
        return train, val, spec
    if d.name == "synthetic":
        train, val = synthetic_images(d.synthetic, cfg.seed, dev)
    else:
        module, _ = IMAGE_SETS[d.name]
        _prepare_files(cfg, ctx)
        folder = Path(d.dir) / (cifar10.FOLDER if d.name == "cifar10" else "MNIST")
        norm = normalizer(module.MEAN, module.STD, dev)
        train, val = (ArrayDataset(*(t.to(dev) for t in module.read_split(folder, split)), norm)
                      for split in ("train", "test"))
    if d.augment:
        gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1000 + ctx.rank)
        train = ArrayDataset(train.inputs, train.targets, augmenter(train.transform, gen))
    return _limit(train, d.train_limit), _limit(val, d.val_limit), spec
