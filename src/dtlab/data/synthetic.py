"""Learnable synthetic data, generated on the training device and determined by the seed.

Images: each class has a smooth random prototype; a sample is its class prototype, shifted by a few
pixels, plus Gaussian noise (`noise` sets the difficulty; the result is scaled to unit variance). Tokens: sequences from a fixed random
Markov chain in which every token has four likely successors, so next-token loss can fall from
ln(vocab) towards the chain's entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtlab.config import SyntheticConfig
from dtlab.data.arrays import ArrayDataset, translate

CHUNK = 512  # samples built at a time (a multiple of 16)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def synthetic_images(
    cfg: SyntheticConfig, seed: int, device: torch.device
) -> tuple[ArrayDataset, ArrayDataset]:
    g = _generator(seed, device)
    c, s, k = cfg.in_channels, cfg.image_size, cfg.num_classes
    coarse = torch.randn(k, c, 4, 4, generator=g, device=device)
    protos = F.interpolate(coarse, size=(s, s), mode="bilinear", align_corners=False)

    # Built CHUNK samples at a time into the data set's own tensor: shifting a whole data set at
    # once held 3.4x its size (the gathered prototypes, their padding, the result) on the device.
    # Noise drawn in chunks of a multiple of 16 samples is, on CPU, the same numbers as one draw.
    chunk = CHUNK if c * s * s >= 16 else cfg.train_samples + cfg.val_samples

    def make(n: int) -> ArrayDataset:
        labels = torch.randint(0, k, (n,), generator=g, device=device)
        dy, dx = torch.randint(-3, 4, (2, n), generator=g, device=device)
        x = torch.empty(n, c, s, s, device=device)
        for i in range(0, n, chunk):  # the shift draws nothing: the noise is drawn in order
            j = slice(i, min(i + chunk, n))
            x[j] = translate(protos[labels[j]], dy[j], dx[j], pad=3) + cfg.noise * torch.randn(
                j.stop - i, c, s, s, generator=g, device=device)
        x /= (1 + cfg.noise**2) ** 0.5  # unit variance whatever the noise: only the SNR changes
        return ArrayDataset(x, labels)

    return make(cfg.train_samples), make(cfg.val_samples)


def synthetic_tokens(
    cfg: SyntheticConfig, seed: int, vocab_size: int, seq_len: int, device: torch.device
) -> tuple[ArrayDataset, ArrayDataset]:
    g = _generator(seed, device)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=g, device=device)
    weights = torch.softmax(2.0 * torch.randn(vocab_size, 4, generator=g, device=device), dim=-1)

    def make(n: int) -> ArrayDataset:
        seq = torch.empty(n, seq_len + 1, dtype=torch.long, device=device)
        seq[:, 0] = torch.randint(0, vocab_size, (n,), generator=g, device=device)
        for t in range(seq_len):
            prev = seq[:, t]
            choice = torch.multinomial(weights[prev], 1, generator=g).squeeze(1)
            seq[:, t + 1] = successors[prev, choice]
        return ArrayDataset(seq[:, :-1], seq[:, 1:])

    return make(cfg.train_samples), make(cfg.val_samples)
