# Shared by run1.sh and run2.sh (the H100 session of 2026-11-27, issue 41 and 45): wheels, the stage timer, the copier.
# Env: BUDGET (seconds for the run's stages), DEV (cuda), SHAPE (1.7b), TINY (set: tiny shapes, the CPU dry run), PY.
DEV=${DEV:-cuda}; SHAPE=${SHAPE:-1.7b}; PY=${PY:-python3}; BUDGET=${BUDGET:-300}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "$DEV" = cuda ]; then
  [ -d /tmp/site/deepspeed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  echo "=== wheels in $(( $(date +%s) - T0 ))s"
fi
GC=/tmp/gc; BE=/tmp/bench; mkdir -p $GC $BE $OUT
copy() {
  cp $GC/gpu_check.jsonl $GC/gpu_table.md $OUT/ 2>/dev/null
  for f in $BE/*/bench-*.json; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"; done
}
( while sleep 3; do copy; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="$PY scripts/benchmarks/gpu_check.py --out $GC --device $DEV --shapes $SHAPE ${TINY:+--tiny}"
B="$PY scripts/benchmarks/bench.py --model $GC/random-$SHAPE --device $DEV --dtype ${DTYPE:-bf16} --algo grpo
   --prompts ${P:-8} --group ${GRP:-8} --max-new ${NEW:-256} --micro-batch ${MB:-16} --steps 3 --warmup 1
   --set rollout.engine=static --set rollout.static.mode=${SM:-graphs} --set train.optimizer_states=${STATES:-bf16}"
finish() { kill $COPIER 2>/dev/null; copy; git log -1 --format=%H > $OUT/commit.txt 2>/dev/null; ls -la $OUT; }
