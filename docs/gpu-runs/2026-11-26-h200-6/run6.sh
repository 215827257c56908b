#!/usr/bin/env bash
# GPU run of 2026-11-26, session 2 (issue 31): DeepSpeed's Muon modules are stand-ins in the trainer's process
# (grpo/training/deepspeed_engine.py skip_deepspeed_muon); the bf16 optimizer (ZeRO 0) and ZeRO-2 import them on a
# GPU. Checks: 10 steps of the 1.7B shape (bf16, static engine, graphs), 3 steps of it under ZeRO-2, the gpu tests.
BUDGET=${BUDGET:-400}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; BZ=/tmp/bench-z2; mkdir -p $GC $BE $BZ
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
git log --oneline -1 > $OUT/commit.txt 2>&1
( while sleep 3; do cp $BE/bench-* $OUT/ 2>/dev/null; mkdir -p $OUT/z2; cp $BZ/bench-* $OUT/z2/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts.bench_ref import random_smollm2; from scripts.gpu_check import SHAPES; import torch; random_smollm2(Path('$GC/random-1.7b'), SHAPES['1.7b'], 'cuda', torch.bfloat16)" 2>&1 | tail -2
echo "=== model built after $(( $(date +%s) - T0 ))s"
COMMON="--model $GC/random-1.7b --device cuda --dtype bf16 --algo grpo --prompts 8 --group 8 --max-new 256 --micro-batch 16 --warmup 1 --set rollout.engine=static --set train.optimizer_states=bf16 --set rollout.static.mode=graphs"
stage python3 scripts/bench.py $COMMON --steps 10 --out $BE
stage python3 -m pytest -p no:cacheprovider -m gpu tests/test_static_engine.py tests/test_cuda.py tests/test_train_passes.py --durations=5
stage python3 scripts/bench.py $COMMON --steps 3 --set train.zero_stage=2 --out $BZ
kill $COPIER; cp $BE/bench-* $OUT/ 2>/dev/null; mkdir -p $OUT/z2; cp $BZ/bench-* $OUT/z2/ 2>/dev/null; ls -la $OUT $OUT/z2
