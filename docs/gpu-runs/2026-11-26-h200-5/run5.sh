#!/usr/bin/env bash
# GPU run of 2026-11-26 (issue 31's start-up changes on a GPU): the Trainer freezes the imported libraries once per
# process instead of its own objects before step 1 (grpo/training/steptime.py), and the reward pool forks its workers
# from a forkserver. Checks: step-time outliers (time/outlier, time/gc) over 10 steps of the 1.7B shape, the
# gpu-marked tests.
BUDGET=${BUDGET:-400}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; mkdir -p $GC $BE
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
( while sleep 3; do cp $BE/bench-* $OUT/ 2>/dev/null; cp $BE/run/metrics.jsonl $OUT/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts.bench_ref import random_smollm2; from scripts.gpu_check import SHAPES; import torch; random_smollm2(Path('$GC/random-1.7b'), SHAPES['1.7b'], 'cuda', torch.bfloat16)" 2>&1 | tail -2
echo "=== model built after $(( $(date +%s) - T0 ))s"
stage python3 scripts/bench.py --model $GC/random-1.7b --device cuda --dtype bf16 --algo grpo --prompts 8 --group 8 --max-new 256 --micro-batch 16 --warmup 1 --set rollout.engine=static --set train.optimizer_states=bf16 --steps 10 --set rollout.static.mode=graphs --out $BE
stage python3 -m pytest -p no:cacheprovider -m gpu tests/test_static_engine.py tests/test_cuda.py --durations=5
kill $COPIER; cp $BE/bench-* $OUT/ 2>/dev/null; ls -la $OUT
