#!/usr/bin/env bash
# GPU run 1 of the third H200 session (2026-11-26): compile+graphs since the KV fix (4a1e722), the HTTP path with the
# one-thread default (5099361), and the gpu-marked tests, which had not run on a GPU since the static engine.
BUDGET=${BUDGET:-330}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; mkdir -p $GC
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
( while sleep 3; do cp $GC/gpu_check.jsonl $OUT/ 2>/dev/null; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="python3 scripts/gpu_check.py --out $GC --device cuda --shapes 1.7b"
stage $G --stages generation --engines static:graphs,static:compile+graphs:0
stage $G --stages ref_http
stage timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_static_engine.py tests/test_cuda.py --durations=10
stage $G --stages generation --engines static:compile+graphs
kill $COPIER; cp $GC/gpu_check.jsonl $OUT/ 2>/dev/null; ls -la $OUT
