#!/usr/bin/env bash
# dtlab's CUDA/NCCL paths on one GPU, the checks CI (CPU only) cannot run:
#   bash benchmarks/gpu_node.sh OUTDIR
# doctor; loss parity single vs ddp/fsdp/fsdp1/zero1 over NCCL (world size 1); a larger GPT in fp32
# and bf16 (throughput, CUDA peak memory, precision_step.py's kernel profile); stop at step 30 and resume from the step-20 checkpoint
# (losses must equal the uninterrupted run's); export; activation memory vs CUDA peak; and the
# refusal of two ranks on one GPU; a memory snapshot, a profiler window and a real OOM. Each command's output goes to OUTDIR/log.txt; results beside it.
# docs/benchmarks.md#one-gpu records what it printed on an H100.
set -u
out=${1:?usage: benchmarks/gpu_node.sh OUTDIR}
mkdir -p "$out"
DT="python3 -m dtlab"
GPT="--config configs/fsdp_gpt.yaml --nproc-per-node 1"  # options first, then overrides
BIG="model.n_layer=12 model.n_head=12 model.n_embd=768 model.block_size=1024 train.global_batch_size=16 train.max_steps=30 train.checkpoint_every=0 data.synthetic.train_samples=2048 data.synthetic.val_samples=64 run.timing_warmup_steps=5"
step() { echo "== $*"; "$@"; echo "== exit $?"; }

{
  step nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  step python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  step $DT doctor
  $DT doctor --json > "$out/doctor_gpu.json"
  # fp32 parity over NCCL: the same 20 steps, per-step losses and final parameters vs single
  step $DT compare $GPT --verify --out "$out/parity" \
    --strategies single,ddp,fsdp,fsdp1,fsdp1:SHARD_GRAD_OP,zero1 train.max_steps=20 train.checkpoint_every=0
  # throughput and CUDA peak memory of a GPT-2-small-sized model (85M in blocks), fp32 and bf16
  step $DT compare $GPT --out "$out/big_fp32" --strategies single,ddp,fsdp,fsdp1 $BIG
  step $DT compare $GPT --out "$out/big_bf16" --strategies single,ddp,fsdp,fsdp1 $BIG train.precision=bf16
  # why FSDP2's bf16 step is slower than autocast's at world size 1: the kernels of each mode
  step python3 benchmarks/precision_step.py --profile --json "$out/precision_step.json"
  step python3 benchmarks/gpu_baseline.py --json "$out/gpu_baseline.json"  # dtlab vs hand-written loops, bf16
  # the ResNet-18 memory question of issue 15: where each side's bytes go at batch 512, bf16,
  # NCHW and channels_last (set-up / warm-up peaks apart: autotuning's workspaces show there)
  step python3 benchmarks/resnet_memory.py --batch 512 --precision bf16 --json "$out/resnet_memory_nchw.json"
  step python3 benchmarks/resnet_memory.py --batch 512 --precision bf16 --channels-last --json "$out/resnet_memory_cl.json"
  step $DT estimate --world-size 1 --strategies ddp,fsdp --config configs/fsdp_gpt.yaml $BIG train.precision=bf16
  # checkpoint and resume on the GPU (FSDP2 over NCCL): a run stopped at step 30 resumes from step 20
  CK="train.max_steps=40 train.checkpoint_every=20 run.log_every=1"
  step $DT train --config configs/fsdp_gpt.yaml $CK run.dir="$out/ck_full"
  step $DT train --config configs/fsdp_gpt.yaml $CK run.dir="$out/ck_cut" run.fault.kind=exit run.fault.step=30
  step $DT train --config configs/fsdp_gpt.yaml $CK run.dir="$out/ck_cut"
  step python3 -c "import sys; from pathlib import Path; from dtlab.cli.compare import read_run, loss_deviation
full, cut = (read_run(Path(sys.argv[1], d))[1] for d in ('ck_full', 'ck_cut'))
print(f'stopped and resumed vs uninterrupted, {len(cut)} steps: largest relative loss deviation {loss_deviation(cut, full):.3g}')" "$out"
  step $DT export "$out/ck_full/checkpoints/step_000040" -o "$out/ck_full/model.safetensors"
  # activations: estimate vs CUDA peak (max_memory_allocated growth)
  step python3 benchmarks/activation_memory.py --json "$out/activation_memory_cuda.json"
  # where the memory goes (issue 17): the allocator's history over steps 3-4 of the GPT-2-small-
  # sized run, a profiler window with its step table, the one-page report; then a real OOM (a
  # micro batch of 512 x 1024 tokens) must stop with one line and leave memory/oom_rank0.*
  step $DT train $GPT $BIG train.precision=bf16 train.max_steps=6 run.memory_snapshot.start=3 \
    run.memory_snapshot.steps=2 run.profile.start=5 run.profile.steps=2 run.dir="$out/snapshot"
  step ls -la "$out/snapshot/memory" "$out/snapshot/profile"
  step $DT report "$out/snapshot"
  step $DT train $GPT $BIG train.precision=bf16 train.global_batch_size=512 train.max_steps=2 \
    data.synthetic.train_samples=1024 run.dir="$out/oom"
  step ls -la "$out/oom/memory"
  # two ranks, one GPU: refused with exit 2; on the CPU (gloo) the same command runs
  step $DT train --nproc-per-node 2 strategy.name=ddp train.max_steps=2 run.dir="$out/two_on_one"
  step $DT train --nproc-per-node 2 strategy.name=ddp train.max_steps=2 run.device=cpu run.dir="$out/two_on_cpu"
} 2>&1 | tee "$out/log.txt"
for d in parity big_fp32 big_bf16; do cp "$out/$d/compare.csv" "$out/compare_$d.csv" 2>/dev/null; done
