"""Imported last by tests/ranks.py's forkserver, before it forks any rank. The forkserver computes
on one thread (a process forked after OpenMP started its thread pool hangs in its first parallel
op: libgomp's pool does not survive a fork, which is what an unpinned `pytest`, with no xdist
worker pinning it to one core, ran into). Then what many ranks would each do after the fork is
done once here:
- the imports of the strategies that import large packages when first used (deepspeed: ~2 s in
  every rank of a deepspeed run, its decorators call torch.compile at import; ZeRO-1's
  torch.distributed.optim; pipelining), and transformers' (~3 s per rank of a model.name=hf run);
- the synthetic data sets of the quick config and of the GPT configs (ranks.memoize_synthetic_images);
- gc.freeze(), so that the gc.collect() dtlab runs before destroying each process group skips the
  objects of torch, dynamo and dtlab imported here (0.43 s per rank otherwise, ~0 after the
  freeze); the objects a run creates are collected as before."""

import gc
import importlib.util
from pathlib import Path

import torch

torch.set_num_threads(1)

import ranks  # noqa: E402

import dtlab.data  # noqa: E402
from dtlab.config import load_config  # noqa: E402

for _module in ("dtlab.strategies.zero1", "dtlab.strategies.pp", "dtlab.strategies.tp",
                "torch.distributed.checkpoint._fsspec_filesystem", "deepspeed",
                # deepspeed.initialize imports its Muon optimizer, which imports inductor: ~1 s
                "deepspeed.runtime.zero.muon.muon_optimizer",
                "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
                "peft"):
    if importlib.util.find_spec(_module.split(".")[0]):  # deepspeed, transformers, peft: extras
        importlib.import_module(_module)
if importlib.util.find_spec("transformers"):
    from dtlab.models import hf

    hf.require_transformers()

ranks.memoize_synthetic_images()
_cpu = torch.device("cpu")
for _config in (None, *sorted(Path(__file__).resolve().parents[1].glob("configs/*_gpt.yaml"))):
    _cfg = load_config(str(_config) if _config else None, [])
    if _cfg.model.name == "gpt":
        dtlab.data.synthetic_tokens(_cfg.data.synthetic, _cfg.seed, _cfg.model.vocab_size,
                                    _cfg.model.block_size, _cpu)
    else:
        dtlab.data.synthetic_images(_cfg.data.synthetic, _cfg.seed, _cpu)
gc.freeze()
