"""What `train.optimizer_impl` buys: the optimizer step alone, for_loop vs foreach vs fused.

    python benchmarks/optimizer_impl.py [--config configs/fsdp_gpt.yaml] [--steps 50] [--threads 1]

The model of the config with random gradients; each implementation steps it `--steps` times after
5 warm-up steps, in turns (A, B, C, A, B, C, ...) so that the machine's state affects all alike;
prints the median milliseconds per step of each and its speed-up over for_loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dtlab.config import load_config
from dtlab.data import spec_for
from dtlab.levers.optim import IMPL_KWARGS, optimizer_spec
from dtlab.models import build_model, count_params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/fsdp_gpt.yaml")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    model = build_model(cfg.model, spec_for(cfg))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {}
    for impl in IMPL_KWARGS:
        cls, kwargs = optimizer_spec(cfg.train.model_copy(update={"optimizer_impl": impl}),
                                     model.parameters())
        opts[impl] = cls(model.parameters(), **kwargs)
    times: dict[str, list[float]] = {impl: [] for impl in opts}
    for i in range(5 + args.steps):
        for impl, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            if i >= 5:
                times[impl].append(time.perf_counter() - t0)
    base = statistics.median(times["for_loop"])
    print(f"{cfg.train.optimizer} over {count_params(model):,} parameters, {args.threads} thread(s)")
    for impl, ts in times.items():
        med = statistics.median(ts)
        print(f"{impl:9s} {med * 1e3:7.2f} ms/step  {base / med:4.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
