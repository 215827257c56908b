#!/usr/bin/env bash
# GPU run 1 of the fourth H200 session (2026-11-26): the peak against TRL at equal optimizer-state precision since the
# cuBLAS-workspace leak fix (1da34ee), the A/B of 8a36640 against f5d55a8 (issue 21 point 4), the gpu-marked tests,
# and compile+graphs with bf16 states.
BUDGET=${BUDGET:-530}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; AB=/tmp/ab-out; mkdir -p $GC $BE $AB
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
copy() { cp $BE/bench-* $OUT/ 2>/dev/null; cp $AB/ab.md $OUT/ 2>/dev/null; for d in $BE/cg; do for f in $d/bench-*; do [ -f "$f" ] && cp "$f" "$OUT/cg-$(basename "$f")"; done; done
  for r in $AB/run-*; do [ -d "$r" ] && mkdir -p $OUT/$(basename $r) && cp $r/metrics.jsonl $r/log.txt $r/resolved.yaml $OUT/$(basename $r)/ 2>/dev/null; done; }
( while sleep 3; do copy; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts.bench_ref import random_smollm2; from scripts.gpu_check import SHAPES; import torch; random_smollm2(Path('$GC/random-1.7b'), SHAPES['1.7b'], 'cuda', torch.bfloat16)" 2>&1 | tail -2
echo "=== model built after $(( $(date +%s) - T0 ))s"
B="python3 scripts/bench.py --model $GC/random-1.7b --device cuda --dtype bf16 --algo grpo --prompts 8 --group 8 --max-new 256 --micro-batch 16 --warmup 1 --set rollout.engine=static --set train.optimizer_states=bf16"
stage $B --vs trl --steps 3 --set rollout.static.mode=graphs --out $BE
stage env MODEL=$GC/random-1.7b STEPS=3 bash .gpurun/ab/ab.sh $AB
stage python3 -m pytest -p no:cacheprovider -m gpu tests/test_static_engine.py tests/test_cuda.py --durations=10
stage $B --steps 3 --set rollout.static.mode=compile+graphs --out $BE/cg
kill $COPIER; copy; ls -la $OUT
