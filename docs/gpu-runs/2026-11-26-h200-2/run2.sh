#!/usr/bin/env bash
# GPU run 2 of 2026-11-26 (second H200 session): compile+graphs with the forward compiled alone (the sampler's cumsum
# failed in Inductor), the HTTP path with one client thread, the reward-model step alone (its own process: a clean peak).
BUDGET=${BUDGET:-460}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; mkdir -p $GC
( while sleep 3; do cp $GC/gpu_check.jsonl $OUT/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="python3 scripts/gpu_check.py --out $GC --device cuda --shapes 1.7b"
stage $G --stages generation --engines static:graphs,static:compile+graphs:0
stage $G --stages ref_http
stage env OMP_NUM_THREADS=1 $G --stages ref_http
stage $G --stages step_rm --step-engine static:graphs --steps 4
stage $G --stages step_256 --step-engine static:compile+graphs:0 --steps 4
stage $G --stages generation --engines static:compile+graphs
kill $COPIER; cp $GC/gpu_check.jsonl $OUT/ 2>/dev/null; ls -la $OUT
