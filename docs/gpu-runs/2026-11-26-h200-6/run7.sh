#!/usr/bin/env bash
# A/B on one warm GPU machine (issue 31): the stand-in Muon modules (A, this commit) against DeepSpeed's real ones
# loaded first (B, .gpurun/realmuon/sitecustomize.py: what every run did before), A again; 6 steps each.
BUDGET=${BUDGET:-300}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; mkdir -p $GC
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
[ -d $GC/random-1.7b ] || python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts.bench_ref import random_smollm2; from scripts.gpu_check import SHAPES; import torch; random_smollm2(Path('$GC/random-1.7b'), SHAPES['1.7b'], 'cuda', torch.bfloat16)" 2>&1 | tail -1
echo "=== model built after $(( $(date +%s) - T0 ))s"
COMMON="--model $GC/random-1.7b --device cuda --dtype bf16 --algo grpo --prompts 8 --group 8 --max-new 256 --micro-batch 16 --warmup 1 --set rollout.engine=static --set train.optimizer_states=bf16 --set rollout.static.mode=graphs --steps 6"
for run in A1 B A2; do
  mkdir -p /tmp/$run $OUT/$run
  if [ $run = B ]; then P=$PWD/.gpurun/realmuon:$PYTHONPATH; else P=$PYTHONPATH; fi
  PYTHONPATH=$P stage python3 scripts/bench.py $COMMON --out /tmp/$run
  cp /tmp/$run/bench-* $OUT/$run/ 2>/dev/null
done
