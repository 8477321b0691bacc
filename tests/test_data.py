"""Data: synthetic generators, the real-format readers, downloads, and who sees which sample."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch
from formats import cifar10_archive, decode_ids, idx_bytes, write_cifar10, write_mnist

from dtlab.cli.main import main
from dtlab.config import SyntheticConfig
from dtlab.data import EvalLoader, TrainLoader, cifar10, mnist, tokens
from dtlab.data.arrays import ArrayDataset, TokenWindows
from dtlab.data.download import download
from dtlab.data.synthetic import synthetic_images, synthetic_tokens
from dtlab.errors import DataError

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ synthetic
def test_synthetic_images_are_deterministic_and_labelled() -> None:
    cfg = SyntheticConfig(train_samples=64, val_samples=16, image_size=16, in_channels=2, num_classes=4)
    a_train, a_val = synthetic_images(cfg, seed=1, device=CPU)
    b_train, _ = synthetic_images(cfg, seed=1, device=CPU)
    c_train, _ = synthetic_images(cfg, seed=2, device=CPU)
    assert a_train.inputs.shape == (64, 2, 16, 16) and len(a_val) == 16
    assert torch.equal(a_train.inputs, b_train.inputs) and torch.equal(a_train.targets, b_train.targets)
    assert not torch.equal(a_train.inputs, c_train.inputs)
    assert set(a_train.targets.tolist()) == {0, 1, 2, 3}
    assert abs(a_train.inputs.std().item() - 1.0) < 0.2  # unit variance whatever the noise


@pytest.mark.parametrize("c, size", [(3, 8), (1, 5)])
def test_synthetic_images_in_chunks_are_the_one_shot_images(monkeypatch, c: int, size: int) -> None:
    """Chunks (here 16 samples, 50 = 3 x 16 + 2) give the very numbers of one shift and one draw."""
    import torch.nn.functional as F

    import dtlab.data.synthetic as synthetic

    cfg = SyntheticConfig(train_samples=50, val_samples=20, image_size=size, in_channels=c,
                          num_classes=3, noise=2.0)
    monkeypatch.setattr(synthetic, "CHUNK", 16)
    train, val = synthetic_images(cfg, seed=3, device=CPU)
    g = torch.Generator().manual_seed(3)
    coarse = torch.randn(3, c, 4, 4, generator=g)
    protos = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    for n, got in ((50, train), (20, val)):
        labels = torch.randint(0, 3, (n,), generator=g)
        dy, dx = torch.randint(-3, 4, (2, n), generator=g)
        x = synthetic.translate(protos[labels], dy, dx, pad=3)
        x = x + 2.0 * torch.randn(n, c, size, size, generator=g)
        x /= 5**0.5
        assert torch.equal(got.targets, labels) and torch.equal(got.inputs, x)


def test_synthetic_images_are_built_within_little_more_than_their_size(monkeypatch, tmp_path) -> None:
    """Shifting the whole set at once peaked at 3.4x its size; in chunks it stays under 1.25x."""
    from torch.profiler import profile

    import dtlab.data.synthetic as synthetic
    from dtlab.instruments.profile_window import timeline_peak

    monkeypatch.setattr(synthetic, "CHUNK", 64)
    cfg = SyntheticConfig(train_samples=2048, val_samples=16, image_size=16)
    with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        train, val = synthetic_images(cfg, seed=0, device=CPU)
    prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    held = sum(t.untyped_storage().nbytes() for d in (train, val) for t in (d.inputs, d.targets))
    assert held <= timeline_peak(tmp_path / "timeline.json")["memory_peak_bytes"] < 1.25 * held


def test_synthetic_tokens_follow_their_chain() -> None:
    cfg = SyntheticConfig(train_samples=32, val_samples=8)
    train, _ = synthetic_tokens(cfg, seed=0, vocab_size=50, seq_len=12, device=CPU)
    x, y = train.batch(torch.arange(4))
    assert x.shape == y.shape == (4, 12) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert int(x.max()) < 50
    again, _ = synthetic_tokens(cfg, seed=0, vocab_size=50, seq_len=12, device=CPU)
    assert torch.equal(train.inputs, again.inputs)
    # Every token has at most four successors: the chain is learnable.
    pairs = {(a, b) for row in train.inputs.tolist() for a, b in zip(row, row[1:], strict=False)}
    assert max(Counter(a for a, _ in pairs).values()) <= 4


# -------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize(("world", "accum"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_ranks_share_out_exactly_the_single_process_batches(world: int, accum: int) -> None:
    n, global_batch = 100, 16
    data = ArrayDataset(torch.arange(n), torch.zeros(n))
    single = TrainLoader(data, 0, 1, global_batch, 1, seed=3).epoch_indices(epoch=1)
    micro = global_batch // (world * accum)
    ranks = [TrainLoader(data, r, world, micro, accum, seed=3).epoch_indices(epoch=1)
             for r in range(world)]
    assert single.shape == (n // global_batch, 1, global_batch)
    for step in range(len(single)):
        together = torch.cat([r[step].flatten() for r in ranks])
        assert sorted(together.tolist()) == sorted(single[step].flatten().tolist())
    used = torch.cat([r.flatten() for r in ranks])
    assert len(set(used.tolist())) == len(used) == (n // global_batch) * global_batch


def test_epochs_reshuffle_and_steps_resume_mid_epoch() -> None:
    data = ArrayDataset(torch.arange(64), torch.zeros(64))
    loader = TrainLoader(data, 0, 1, 8, 1, seed=0)
    assert not torch.equal(loader.epoch_indices(0), loader.epoch_indices(1))
    stream = list(islice(loader.steps(), 20))
    resumed = list(islice(loader.steps(start_step=13), 7))
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(stream[13:], resumed, strict=True))
    assert [epoch for epoch, _ in islice(loader.steps(start_step=7), 3)] == [0, 1, 1]


def test_too_small_dataset_is_an_error() -> None:
    with pytest.raises(DataError, match="fewer than one global batch of 64"):
        TrainLoader(ArrayDataset(torch.arange(50), torch.zeros(50)), 0, 2, 32, 1, seed=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_evaluation_counts_every_sample_once(world: int) -> None:
    n = 23
    data = ArrayDataset(torch.arange(n), torch.arange(n))
    seen, batches = [], []
    for r in range(world):
        loader = EvalLoader(data, r, world, batch_size=4)
        parts = list(loader)
        batches.append(len(parts))
        for x, _, mask in parts:
            seen += x[mask.bool()].tolist()
    assert sorted(seen) == list(range(n))
    assert len(set(batches)) == 1  # the same number of forward passes on every rank


# ------------------------------------------------------------------------------- CIFAR-10
def test_cifar10_reader_round_trips(tmp_path) -> None:
    folder = write_cifar10(tmp_path, per_file=10, test=7)
    images, labels = cifar10.read_split(folder, "train")
    assert images.shape == (50, 3, 32, 32) and images.dtype == torch.uint8
    assert decode_ids(images.numpy()) == list(range(50))
    assert labels.tolist() == [i % 10 for i in range(50)]
    test_images, _ = cifar10.read_split(folder, "test")
    assert len(test_images) == 7


def test_cifar10_truncated_or_corrupt(tmp_path) -> None:
    folder = write_cifar10(tmp_path, per_file=10)
    path = folder / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match="data_batch_3.bin is truncated or corrupt"):
        cifar10.read_split(folder, "train")
    folder = write_cifar10(tmp_path / "b", per_file=10)
    raw = bytearray((folder / "test_batch.bin").read_bytes())
    raw[0] = 200  # a label byte outside 0-9
    (folder / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="label 200 is outside 0-9"):
        cifar10.read_split(folder, "test")


def test_cifar10_missing_without_download(tmp_path) -> None:
    with pytest.raises(DataError, match="fix: set data.download=true"):
        cifar10.prepare(tmp_path, download_ok=False)


def test_cifar10_download_verifies_and_extracts(tmp_path) -> None:
    write_cifar10(tmp_path / "src", per_file=5, test=5)
    archive = cifar10_archive(tmp_path / "src", tmp_path / "cifar-10-binary.tar.gz")
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    root = tmp_path / "data"
    folder = cifar10.prepare(root, True, url=archive.as_uri(), md5=md5)
    assert len(cifar10.read_split(folder, "train")[0]) == 25
    with pytest.raises(DataError, match="checksum mismatch"):
        download(archive.as_uri(), tmp_path / "other" / "x.tar.gz", md5="0" * 32)
    assert not list((tmp_path / "other").iterdir())  # nothing half-written is left behind


def test_download_failure_is_explained(tmp_path) -> None:
    with pytest.raises(DataError, match="cannot download"):
        download((tmp_path / "absent.tar.gz").as_uri(), tmp_path / "x", md5="0" * 32)


def test_resnet_trains_on_cifar10_files_with_augmentation(tmp_path) -> None:
    write_cifar10(tmp_path, per_file=8, test=6)
    run = tmp_path / "run"
    assert main(["train", "model.name=resnet", "model.width=0.0625", "data.name=cifar10",
                 f"data.dir={tmp_path}", "data.augment=true", f"run.dir={run}",
                 "train.global_batch_size=20", "train.epochs=1", "run.progress=false"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["model"] == "resnet"
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_count"] == 6


def test_corrupt_cifar10_through_the_cli(tmp_path, capsys) -> None:
    folder = write_cifar10(tmp_path, per_file=10)
    (folder / "data_batch_1.bin").write_bytes(b"\x01" * 5000)
    code = main(["train", "model.name=cnn", "data.name=cifar10", f"data.dir={tmp_path}",
                 f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data_batch_1.bin is truncated or corrupt" in err[0]


# ---------------------------------------------------------------------------------- MNIST
@pytest.mark.parametrize("gz", [True, False])
def test_mnist_reader(tmp_path, gz: bool) -> None:
    folder = write_mnist(tmp_path, train=30, test=12, gz=gz)
    images, labels = mnist.read_split(folder, "train")
    assert images.shape == (30, 1, 28, 28) and decode_ids(images.numpy()) == list(range(30))
    assert labels.tolist() == [i % 10 for i in range(30)]
    assert mnist.prepare(tmp_path, download_ok=False) == folder


def test_mnist_corrupt_files(tmp_path) -> None:
    folder = write_mnist(tmp_path, gz=False)
    name = folder / mnist.FILES["train"][0]
    name.write_bytes(name.read_bytes()[:-10])
    with pytest.raises(DataError, match="truncated or corrupt"):
        mnist.read_split(folder, "train")
    name.write_bytes(idx_bytes(np.zeros((2, 2), np.uint8)))  # 2-D where 3-D is needed
    with pytest.raises(DataError, match="bad header"):
        mnist.read_split(folder, "train")
    gz = write_mnist(tmp_path / "g") / (mnist.FILES["test"][1] + ".gz")
    gz.write_bytes(gz.read_bytes()[:20])
    with pytest.raises(DataError, match="cannot be read"):
        mnist.read_split(gz.parent, "test")


def test_corrupt_mnist_through_the_cli(tmp_path, capsys) -> None:
    folder = write_mnist(tmp_path)
    labels = folder / (mnist.FILES["test"][1] + ".gz")
    labels.write_bytes(labels.read_bytes()[:-3])  # a truncated download
    code = main(["train", "data.name=mnist", f"data.dir={tmp_path}", f"run.dir={tmp_path / 'r'}",
                 "train.global_batch_size=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "t10k-labels-idx1-ubyte.gz cannot be read" in err[0]


def test_mnist_trains_from_idx_files(tmp_path) -> None:
    write_mnist(tmp_path, train=40, test=10)
    run = tmp_path / "run"
    assert main(["train", "data.name=mnist", f"data.dir={tmp_path}", f"run.dir={run}",
                 "train.global_batch_size=10", "train.epochs=1", "run.progress=false"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["data"] == "mnist"


def test_mnist_download_from_a_mirror(tmp_path) -> None:
    src = write_mnist(tmp_path / "mirror")
    sums = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in src.iterdir()}
    folder = mnist.prepare(tmp_path / "data", True, mirror=src.as_uri() + "/", md5=sums)
    assert len(mnist.read_split(folder, "test")[0]) == 20


# --------------------------------------------------------------------------------- tokens
def test_token_files(tmp_path) -> None:
    ids = np.arange(1000, dtype=np.uint16) % 97
    ids.tofile(tmp_path / "train.bin")
    arr = tokens.open_split(tmp_path, "train", vocab_size=100, seq_len=16)
    windows = TokenWindows(arr, 16, CPU)
    assert len(windows) == (1000 - 1) // 16
    x, y = windows.batch(torch.tensor([0, 2]))
    assert x.shape == (2, 16) and x[1, 0].item() == 32 % 97 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError, match="set model.vocab_size to at least 97"):
        tokens.open_split(tmp_path, "train", vocab_size=50, seq_len=16)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 300}))
    with pytest.raises(DataError, match="at least 300"):
        tokens.open_split(tmp_path, "train", vocab_size=100, seq_len=16)
    with pytest.raises(DataError, match="val.bin not found"):
        tokens.open_split(tmp_path, "val", vocab_size=100, seq_len=16)
