"""Imported last by tests/ranks.py's forkserver, before it forks any rank: the quick config's
synthetic images made once (ranks.memoize_synthetic_images), then gc.freeze(), so that the
gc.collect() dtlab runs before destroying each process group skips the objects of torch, dynamo
and dtlab imported here (0.43 s per rank otherwise, ~0 after the freeze); the objects a run
creates are collected as before."""

import gc

import ranks
import torch

import dtlab.data
from dtlab.config import load_config

ranks.memoize_synthetic_images()
_quick = load_config(None, [])
dtlab.data.synthetic_images(_quick.data.synthetic, _quick.seed, torch.device("cpu"))
gc.freeze()
