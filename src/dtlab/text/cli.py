"""`dtlab prepare` (text -> token files) and `dtlab sample` (a trained GPT -> text): arguments and
commands, registered by dtlab/cli/main.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtlab.cli_args import input_dir, integer, number, output_dir
from dtlab.errors import DtlabError


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".txt/.md/.jsonl/.parquet files, directories of them, or a Hugging Face "
                        "dataset name (needs `datasets` and the network)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for train.bin, val.bin and meta.json (data.dir of a run): "
                        "new, empty, or an earlier data set, which is replaced whole")
    p.add_argument("--tokenizer", default="bytes", metavar="NAME",
                   help="bytes (UTF-8 bytes, vocabulary 256: the GPT configs' size), gpt2 "
                        "(tiktoken), or a local Hugging Face tokenizer directory (default: bytes)")
    p.add_argument("--val-fraction", type=number(0, "--val-fraction 0.1", inclusive=False),
                   default=0.1, metavar="F", help="the last F of the tokens form val.bin (default 0.1)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field holding the text in .jsonl/.parquet/datasets rows (default: text)")
    p.add_argument("--workers", type=integer(1, "--workers 4"), metavar="N",
                   help="tokenizing processes for inputs over 4 MB (default: cores, at most 8)")


def cmd_prepare(args: argparse.Namespace) -> int:
    from dtlab.text.prepare import prepare

    if args.val_fraction >= 1:
        raise DtlabError(f"--val-fraction {args.val_fraction} leaves nothing to train on; fix: "
                         "a fraction below 1, e.g. 0.1")
    out = output_dir("--out", args.out)
    meta = prepare(args.inputs, out, args.tokenizer, args.val_fraction, args.text_field,
                   args.workers or 0)
    t = meta["tokens"]
    docs = meta["documents"]
    print(f"{docs} document{'s' if docs != 1 else ''} -> {t['train']:,} train and "
          f"{t['val']:,} val tokens "
          f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}, {meta['tokenizer']['kind']}) "
          f"in {out}")
    print(f"train on it: dtlab train --config configs/fsdp_gpt.yaml data.name=tokens "
          f"data.dir={out} model.vocab_size={meta['vocab_size']}")
    return 0


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a run directory or one of its checkpoints (RUN_DIR/checkpoints/step_N)")
    p.add_argument("--prompt", default="\n", metavar="TEXT",
                   help="text to continue (token ids for a run on synthetic tokens)")
    p.add_argument("--tokens", type=integer(1, "--tokens 200"), default=200, metavar="N",
                   help="tokens to generate, at most 10 x the model's context (block_size); "
                   "past its context each token is drawn from the last block_size (default 200)")
    p.add_argument("--temperature", type=number(0, "--temperature 0.8"), default=0.8,
                   metavar="T", help="softmax temperature; 0 = always the most likely token")
    p.add_argument("--top-k", type=integer(0, "--top-k 50"), default=50, metavar="K",
                   help="sample among the K most likely tokens; 0 = all (default 50)")
    p.add_argument("--seed", type=integer(0, "--seed 0", 2**63 - 1), default=0, metavar="S",
                   help="the generator's seed: the same command prints the same text")
    p.add_argument("--samples", type=integer(1, "--samples 3"), default=1, metavar="N",
                   help="independent samples (seeds S, S+1, ...)")
    p.add_argument("--nproc-per-node", type=integer(1, "--nproc-per-node 2"), default=1,
                   metavar="N", help="split the model over N ranks of this machine (one per GPU, "
                   "else one per core; default 1: one process, no split)")
    p.add_argument("--inference", choices=["tp", "deepspeed"], metavar="tp|deepspeed",
                   help="how N ranks split the model: tp (torch tensor parallelism: dtlab's GPT, "
                   "Llama-family hf models) or deepspeed (DeepSpeed inference, AutoTP: "
                   "Llama-family hf models); default with N > 1: tp")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="with N > 1: where the ranks compute (auto: one GPU each when there are "
                   "GPUs, with NCCL; else the CPU, with gloo)")
    p.add_argument("--kernel-inject", action="store_true",
                   help="with --inference deepspeed on CUDA: DeepSpeed's fused inference kernels "
                   "in fp16 (kernel injection, for the Hugging Face models it has kernels for, "
                   "GPT-2-style ones too) instead of AutoTP")
    p.add_argument("--verify", action="store_true",
                   help="with N > 1: decode --tokens tokens greedily on the ranks and in one "
                   "process, compare the logits (tolerance 1e-5) and tokens; exit 1 if they differ")


def cmd_sample(args: argparse.Namespace) -> int:
    from dtlab.text.sample import sample

    source = input_dir("RUN_OR_CHECKPOINT", args.source,
                       "pass a run directory or RUN_DIR/checkpoints/step_NNNNNN")
    if args.verify and args.nproc_per_node == 1:
        raise DtlabError("--verify compares ranks that split the model with one process, and "
                         "--nproc-per-node is 1; fix: add --nproc-per-node 2, or drop --verify")
    if args.device != "auto" and args.nproc_per_node == 1:
        raise DtlabError(f"--device {args.device} chooses where split ranks compute, and "
                         "--nproc-per-node is 1 (one process samples on the CPU); fix: add "
                         "--nproc-per-node 2, or drop --device")
    if args.kernel_inject and args.inference != "deepspeed":
        raise DtlabError("--kernel-inject is DeepSpeed's (its fused CUDA kernels); fix: add "
                         "--inference deepspeed, or drop --kernel-inject")
    if args.kernel_inject and args.verify:
        raise DtlabError("--verify compares with one float32 process to 1e-5, and --kernel-inject "
                         "computes in fp16; fix: verify without --kernel-inject (AutoTP)")
    if args.nproc_per_node > 1 or args.inference:
        from dtlab.text.sample_ranks import sample_on_ranks

        args.inference = args.inference or "tp"
        return sample_on_ranks(Path(source), args)
    tokens, seconds = sample(Path(source), args.prompt, args.tokens, args.temperature,
                             args.top_k, args.seed, args.samples, sys.stdout)
    print(f"dtlab: {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} "
          "tokens/s)", file=sys.stderr)
    return 0
