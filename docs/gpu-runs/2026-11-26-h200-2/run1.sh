#!/usr/bin/env bash
# GPU run of 2026-11-26 (second H200 session): outliers over 12 steps, the reward model's cost (issue 23), the HTTP
# path's parts, the decode step's profile, which part Inductor fails on, the memory parts with bf16 optimizer states.
BUDGET=${BUDGET:-400}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; mkdir -p $GC
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
( while sleep 3; do cp $GC/gpu_check.jsonl $GC/gpu_table.md $OUT/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="python3 scripts/gpu_check.py --out $GC --device cuda --shapes 1.7b"
stage $G --stages step_256,step_rm --step-engine static:graphs --steps 12
stage $G --stages ref_http,decode_profile
stage timeout 100 $G --stages compile_probe
stage $G --stages step_256 --step-engine static:graphs --optimizer-states bf16 --steps 4
kill $COPIER; cp $GC/gpu_check.jsonl $GC/gpu_table.md $OUT/ 2>/dev/null; ls -la $OUT
