"""Imported last by tests/ranks.py's forkserver, before it forks any rank: the quick config's
synthetic images made once (ranks.memoize_synthetic_images), then gc.freeze(), so that the
gc.collect() dtlab runs before destroying each process group skips the objects of torch, dynamo
and dtlab imported here (0.43 s per rank otherwise, ~0 after the freeze); the objects a run
creates are collected as before. The forkserver computes on one thread: a process forked after
OpenMP started its thread pool hangs in its first parallel op (libgomp's pool does not survive a
fork), which is what an unpinned `pytest` (no xdist worker pinning it to one core) ran into."""

import gc

import ranks
import torch

import dtlab.data
from dtlab.config import load_config

torch.set_num_threads(1)
ranks.memoize_synthetic_images()
_quick = load_config(None, [])
dtlab.data.synthetic_images(_quick.data.synthetic, _quick.seed, torch.device("cpu"))
gc.freeze()
