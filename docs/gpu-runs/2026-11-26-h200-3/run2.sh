#!/usr/bin/env bash
# GPU run 2 of the third H200 session (2026-11-26): the step against TRL with compile+graphs at equal optimizer-state precision
# (bf16 on both sides), each phase's peak (memory/*), a smaller LM-head chunk, and 1024 new tokens with compile.
BUDGET=${BUDGET:-430}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; mkdir -p $GC $BE
( while sleep 3; do cp $GC/gpu_check.jsonl $BE/bench-* $OUT/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="python3 scripts/gpu_check.py --out $GC --device cuda --shapes 1.7b"
python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts.bench_ref import random_smollm2; from scripts.gpu_check import SHAPES; import torch; random_smollm2(Path('$GC/random-1.7b'), SHAPES['1.7b'], 'cuda', torch.bfloat16)" 2>&1 | tail -2
stage python3 scripts/bench.py --model $GC/random-1.7b --vs trl --device cuda --dtype bf16 --algo grpo \
  --prompts 8 --group 8 --max-new 256 --micro-batch 16 --steps 3 --warmup 1 \
  --set rollout.engine=static --set rollout.static.mode=compile+graphs --set train.optimizer_states=bf16 --out $BE
stage $G --stages step_256 --step-engine static:compile+graphs --optimizer-states bf16 --set train.logprob_chunk_size=512 --steps 3
stage $G --stages step_1024 --step-engine static:compile+graphs --optimizer-states bf16 --steps 2
kill $COPIER; cp $GC/gpu_check.jsonl $BE/bench-* $OUT/ 2>/dev/null; ls -la $OUT
