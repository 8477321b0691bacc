"""`dtlab sample SOURCE --nproc-per-node N --inference tp|deepspeed [--verify]`: text from a model
split over N ranks (text/sharded.py), with what it measured.

The command checks everything it can before any rank starts (the source, the prompt, the
model/strategy pair, N against the model's sizes and the machine: one line each, exit 2), then
starts N ranks with dtlab's launcher (dtlab/process/launch.py: loopback rendezvous on a free
port, threads per rank = cores / ranks, a signal stops every rank with one line). Each rank
loads the model, keeps its shard, and generates in step with the others (every rank computes
the same logits, so draws the same tokens from the same seeded generator); rank 0 writes the
text, then the measurements on stderr: time to first token, decode rate, and per rank the bytes
of its weights and its peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: the process's
peak resident set size, which includes Python and torch themselves).

--verify: the ranks also decode --tokens tokens greedily and rank 0 writes each step's logits to
a file (safetensors); this process then decodes them with the unsharded model and compares: the
largest absolute difference of the logits (tolerance 1e-5) and the tokens. Over the tolerance,
or another token: one line, exit 1.
"""

from __future__ import annotations

# ruff: noqa: E402 - a worker's signal handling starts before its imports (torch takes seconds)
if __name__ == "__main__":
    from dtlab.process.early_exit import exit_on_signals

    exit_on_signals()

import argparse
import contextlib
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from dtlab.errors import DtlabError
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted
from dtlab.text import sharded
from dtlab.text.sample import generate, load, tokenizer_and_prompt, write_sample

STOP_DEADLINE_S = 3.0  # the least time a stop waits for the token under way
TOLERANCE = 1e-5  # largest absolute difference of fp32 logits --verify accepts
MODULE = "dtlab.text.sample_ranks"


def sample_on_ranks(source: Path, args: argparse.Namespace) -> int:
    """The command's side: check, launch the ranks, and with --verify compare their greedy
    decoding with this process's; returns the exit code."""
    from dtlab.process.launch import launch

    cfg, model = load(source)
    sharded.check(cfg, args.inference, args.nproc_per_node, args.device, args.kernel_inject)
    _, ids = tokenizer_and_prompt(cfg, args.prompt, args.tokens)
    worker_args = [str(source.resolve()), f"--prompt={args.prompt}", f"--tokens={args.tokens}",
                   f"--temperature={args.temperature}", f"--top-k={args.top_k}",
                   f"--seed={args.seed}", f"--samples={args.samples}",
                   f"--inference={args.inference}", f"--device={args.device}",
                   *(["--kernel-inject"] if args.kernel_inject else [])]
    with tempfile.TemporaryDirectory(prefix="dtlab-sample-") as tmp:
        greedy_file = Path(tmp) / "greedy.safetensors"
        if args.verify:
            worker_args.append(f"--verify-file={greedy_file}")
        code = launch(worker_args, args.nproc_per_node, module=MODULE)
        if code or not args.verify:
            return code
        return verify(model, ids, args.tokens, cfg.model.block_size, greedy_file,
                      f"{args.nproc_per_node}-rank {args.inference}")


def greedy(forward: Callable[[torch.Tensor], torch.Tensor], ids: list[int], tokens: int,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the `tokens` most likely ids after `ids`, one at a time; each step's last-position logits)."""
    seq, rows = list(ids), []
    with torch.no_grad():
        for _ in range(tokens):
            row = forward(torch.tensor([seq[-block_size:]]))[0, -1].float()
            rows.append(row)
            seq.append(int(row.argmax()))
    return torch.tensor(seq[len(ids):]), torch.stack(rows)


def verify(model: torch.nn.Module, ids: list[int], tokens: int, block_size: int, file: Path,
           what: str) -> int:
    """The ranks' greedy tokens and logits (`file`) against one process's: a line, exit 0 or 1."""
    from safetensors.torch import load_file

    ranks = load_file(str(file))
    ref_tokens, ref_logits = greedy(model.eval(), ids, tokens, block_size)
    diff = float((ranks["logits"] - ref_logits).abs().max())
    same = int((ranks["tokens"] == ref_tokens).sum())
    said = (f"{what} logits differ from one process's by at most {diff:.1e} (over {tokens} "
            f"greedy steps; tolerance {TOLERANCE:.0e}); greedy tokens: {same} of {tokens} "
            "identical")
    if diff <= TOLERANCE and same == tokens:
        print(f"dtlab: verify: {said}", file=sys.stderr)
        return 0
    print(f"dtlab: error: --verify failed: {said}", file=sys.stderr)
    return 1


def _timed(new: Iterable[int], times: list[float]) -> Iterator[int]:
    """`new`, noting the seconds from the start to each id."""
    start = time.perf_counter()
    for i in new:
        times.append(time.perf_counter() - start)
        yield i


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "peak CUDA memory allocated"
    # ru_maxrss is in KiB on Linux
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), \
        "peak RSS (the whole process: Python, torch and the weights)"


def _weight_bytes(model: torch.nn.Module) -> float:
    """Bytes of the weights this rank holds (its shards of split tensors)."""
    from torch.distributed.tensor import DTensor

    return float(sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                     for p in model.parameters()))


def _mib(values: list[float]) -> str:
    return ", ".join(f"{v / 2**20:.1f}" for v in values) + " MiB"


def _stopping_together(forward: sharded.Forward, ctx: Any) -> sharded.Forward:
    """`forward`, with the ranks' agreement to stop before each token (an all-reduce of the
    largest stop signal any rank holds): a signal stops every rank at the same token, and a
    rank that died is noticed by the others as a failed collective, so the launcher's SIGTERM
    that follows is no stop of theirs to report (main). A token that does not come within 3 x
    the longest one so far (a hang) is stopped anyway (interrupt.deferred)."""
    longest = 0.0

    def voted(idx: torch.Tensor) -> torch.Tensor:
        nonlocal longest
        if signum := ctx.agree_stop(interrupt.requested() or 0):
            raise Interrupted(signum)
        start = time.perf_counter()
        logits = forward(idx)
        longest = max(longest, time.perf_counter() - start)
        interrupt.set_deadline(max(STOP_DEADLINE_S, 3 * longest))
        return logits

    return voted


def generate_on_ranks(args: argparse.Namespace, ctx: Any) -> None:
    cfg, model = load(Path(args.source))
    tok, ids = tokenizer_and_prompt(cfg, args.prompt, args.tokens, note=False)  # said once
    block = cfg.model.block_size
    split, weights = sharded.shard(model, args.inference, ctx, args.kernel_inject)
    forward = _stopping_together(split, ctx)

    class Forward(torch.nn.Module):  # what generate() calls
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return forward(idx)

    first, decode_s, decoded = [], 0.0, 0
    # every rank generates (its shard takes part in each token); rank 0 writes the text
    with contextlib.nullcontext(sys.stdout) if ctx.is_main else open(os.devnull, "w") as out, \
            interrupt.deferred(STOP_DEADLINE_S):
        for i in range(args.samples):
            times: list[float] = []
            new = generate(Forward(), ids, args.tokens, block, args.temperature, args.top_k,
                           args.seed + i)
            write_sample(out, i, args.prompt, tok, ids, _timed(new, times))
            first.append(times[0])
            decode_s, decoded = decode_s + times[-1] - times[0], decoded + len(times) - 1
        out.write("\n")
        out.flush()
    peak, label = _peak_memory(ctx.device)
    per_rank = ctx.gather_floats([_weight_bytes(weights), peak])
    if args.verify_file:
        with interrupt.deferred(STOP_DEADLINE_S):
            tokens, logits = greedy(forward, ids, args.tokens, block)
        if ctx.is_main:
            from safetensors.torch import save_file

            save_file({"tokens": tokens, "logits": logits.contiguous()}, args.verify_file)
    if ctx.is_main:
        rate = f"{decoded / decode_s:.1f} tokens/s" if decoded and decode_s > 0 else "n/a"
        first.sort()
        print(f"dtlab: {args.inference} on {ctx.world_size} ranks ({ctx.device.type}, "
              f"{ctx.backend}): time to first token {first[len(first) // 2] * 1e3:.1f} ms "
              f"(median of {len(first)} sample(s)); decode {rate} ({decoded} tokens after the "
              "first of each sample; no KV cache: each token runs the whole context)\n"
              f"dtlab: per rank: weights {_mib([r[0] for r in per_rank])}; "
              f"{label} {_mib([r[1] for r in per_rank])}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """A rank's entry point (python -m dtlab.text.sample_ranks), started by sample_on_ranks."""
    from dtlab.distributed import detect_env, distributed, is_comm_failure

    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    p.add_argument("source")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--top-k", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--inference", choices=sharded.STRATEGIES, required=True)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--kernel-inject", action="store_true")
    p.add_argument("--verify-file")
    args = p.parse_args(argv)
    is_main = detect_env().rank == 0
    with interrupt.handling():
        try:
            try:
                with distributed(args.device, need_group=True) as ctx:
                    generate_on_ranks(args, ctx)
            except RuntimeError as e:
                if not is_comm_failure(e):
                    raise
                # A peer stopped (a signal, or it failed, and the launcher names it): this rank
                # stops as one the launcher stopped, quietly.
                interrupt.mark_collateral()
                raise Interrupted(interrupt.requested() or signal.SIGTERM, quiet=True) from None
        except DtlabError as e:
            print(f"dtlab: error: {e}", file=sys.stderr)
            return e.exit_code
        except Interrupted as e:
            return interrupt.report(e, main=is_main)
    return 0


if __name__ == "__main__":
    from dtlab.distributed import leave

    leave(main())
