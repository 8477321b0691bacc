"""`dtlab estimate` against what `dtlab train` measures, for the models dtlab trains.

    python benchmarks/estimate_vs_measured.py [--out runs/estimate] [--json FILE]

Runs `dtlab compare` on 2 ranks for the quick CNN, ResNet-18 and the GPT of configs/fsdp_gpt.yaml
with ddp, fsdp, fsdp1 (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), and DeepSpeed ZeRO 1/2/3 where the
extra is installed (or --strategies), then compares per rank:
- the exact state bytes of each run's summary.json with the estimate's (measured under the fake
  backend, src/dtlab/estimate/measure.py; DeepSpeed's modelled in
  src/dtlab/strategies/deepspeed_memory.py);
- (CNN and GPT, run.comm_breakdown=true) the ring traffic of the collectives the profiler saw
  with the estimated volume, and the measured communication time with the time predicted from
  the alpha-beta fit of a `dtlab comm --json` result (default docs/results/comm_all_2ranks.json,
  measured on this machine; --comm-results FILE for one measured just before, under the same load).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = "ddp,fsdp,fsdp1,fsdp1:SHARD_GRAD_OP,fsdp1:NO_SHARD"
if importlib.util.find_spec("deepspeed") is not None:
    STRATEGIES += ",deepspeed:1,deepspeed:2,deepspeed:3"
MODELS = [  # (label, compare arguments, with the communication breakdown)
    ("quick CNN", ["--config", "configs/quick.yaml", "train.max_steps=14"], True),
    ("ResNet-18", ["model.name=resnet", "train.global_batch_size=16", "train.max_steps=2",
                   "data.synthetic.train_samples=256", "data.synthetic.val_samples=32"], False),
    ("GPT (fsdp_gpt.yaml)", ["--config", "configs/fsdp_gpt.yaml", "train.max_steps=14",
                             "train.checkpoint_every=0"], True),
]
COMM_RESULTS = ROOT / "docs/results/comm_all_2ranks.json"


def compare_rows(label: str, out: Path, breakdown: bool, comm_results: Path,
                 strategies: str) -> list[dict]:
    from dtlab.config import load_config
    from dtlab.estimate.comm import load_comm_results
    from dtlab.estimate.core import Setup, estimate, model_from_config, optimizer_of, precision_of

    links = load_comm_results(comm_results)
    rows = []
    for spec in strategies.split(","):
        run = out / spec.replace(":", "-")
        summary = json.loads((run / "summary.json").read_text())
        mem = summary["memory_per_rank"]
        model = model_from_config(str(run / "config.yaml"), [])
        cfg = load_config(run / "config.yaml")
        setup = Setup(model, 2, 2, precision_of(cfg), optimizer_of(cfg), 1, False, links, "gloo")
        est = estimate(setup, cfg.strategy.name)
        per_rank = est["per_rank"]
        row = {"model": label, "strategy": spec, "n_params": summary["n_params"]}
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            row[key] = mem[key]
            row[f"{key}_est"] = [r[key] for r in per_rank]
        row["max_rel_error"] = max(abs(e - m) / m for key in ("param_bytes", "grad_bytes", "optim_bytes")
                                   for e, m in zip(row[f"{key}_est"], mem[key], strict=True))
        if "buffer_bytes" in per_rank[0]:  # DeepSpeed's buckets and staging buffers
            row["buffer_bytes"] = mem["buffer_bytes"]
            row["buffer_bytes_est"] = [r["buffer_bytes"] for r in per_rank]
        if breakdown and "comm_breakdown" in summary:
            b = summary["comm_breakdown"]
            row["traffic_measured"] = b["traffic_bytes_per_step"]
            row["traffic_est"] = est["comm"]["traffic_bytes"]
            row["comm_s_measured"] = summary["comm_time_s"]
            row["comm_s_predicted"] = est["comm"]["time_s"]
            row["step_s"] = b["step_time_s"]
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/estimate")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--reuse", action="store_true", help="only compare existing runs")
    p.add_argument("--comm-results", type=Path, default=COMM_RESULTS,
                   help="dtlab comm --json file for the predicted times")
    p.add_argument("--strategies", default=STRATEGIES, help=f"default {STRATEGIES}")
    args = p.parse_args()
    rows = []
    for label, extra, breakdown in MODELS:
        out = Path(args.out) / label.split()[0].lower()
        if not args.reuse:
            cmd = [sys.executable, "-m", "dtlab", "compare", "--strategies", args.strategies,
                   "--nproc-per-node", "2", "--out", str(out), *extra]
            cmd += ["run.comm_breakdown=true"] if breakdown else []
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows += compare_rows(label, out, breakdown, args.comm_results, args.strategies)
    print("| model | strategy | param bytes per rank (measured = estimate unless shown) | "
          "grad bytes | optim bytes | max error |")
    print("| --- | --- | --- | --- | --- | --- |")
    def pair(r: dict, key: str) -> str:
        m, e = r[key], r[f"{key}_est"]
        text = ", ".join(f"{a:,}" for a in m)
        return text if m == e else text + " (estimate " + ", ".join(f"{a:,}" for a in e) + ")"

    for r in rows:
        print(f"| {r['model']} | {r['strategy']} | {pair(r, 'param_bytes')} | {pair(r, 'grad_bytes')} | "
              f"{pair(r, 'optim_bytes')} | {100 * r['max_rel_error']:.2f}% |")
    if any("buffer_bytes" in r for r in rows):
        print()
        print("| model | strategy | buffer bytes per rank, measured | estimated |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            if "buffer_bytes" in r:
                print(f"| {r['model']} | {r['strategy']} | "
                      + ", ".join(f"{b:,}" for b in r["buffer_bytes"]) + " | "
                      + ", ".join(f"{b:,}" for b in r["buffer_bytes_est"]) + " |")
    print()
    print("| model | strategy | traffic/step measured | estimated | comm time measured (ms) | "
          "predicted (ms) | step (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "traffic_measured" in r:
            print(f"| {r['model']} | {r['strategy']} | {r['traffic_measured']:,.0f} | "
                  f"{r['traffic_est']:,.0f} | {1e3 * r['comm_s_measured']:.2f} | "
                  f"{1e3 * r['comm_s_predicted']:.2f} | {1e3 * r['step_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
