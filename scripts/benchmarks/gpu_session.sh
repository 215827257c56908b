#!/usr/bin/env bash
# The GPU session's run of issues 21 and 41 (docs/results.md, 2026-11-26): every stage of scripts/benchmarks/gpu_check.py and
# scripts/benchmarks/bench.py --vs trl, each under what is left of BUDGET seconds, results copied to $OUT every 3 s.
#   BUDGET=545 OUT=/tmp/out bash scripts/benchmarks/gpu_session.sh                       # on the GPU machine (needs trl)
#   OUT=/tmp/o DEV=cpu SHAPE=tiny TINY=1 DTYPE=fp32 SM=eager CM=compile P=2 GRP=2 NEW=8 bash scripts/benchmarks/gpu_session.sh
# Env: SHAPE (1.7b), DEV (cuda), DTYPE (bf16), SM (static mode of the steps: graphs), CM (compiled mode tried:
# compile+graphs), P / GRP / NEW / MB (bench: prompts, G, new tokens, micro-batch), PY (python3).
SHAPE=${SHAPE:-1.7b}; BUDGET=${BUDGET:-560}; DEV=${DEV:-cuda}; PY=${PY:-python3}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; mkdir -p $GC $BE
copy() {
  cp $GC/gpu_check.jsonl $GC/gpu_table.md $BE/bench-* $OUT/ 2>/dev/null
  for d in 1024 bf16 eos; do for f in $BE/$d/bench-*; do [ -f "$f" ] && cp "$f" "$OUT/$d-$(basename "$f")"; done; done
}
( while sleep 3; do copy; done ) &
COPIER=$!
stage() { local l; l=$(left); echo "=== [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
G="$PY scripts/benchmarks/gpu_check.py --out $GC --device $DEV --shapes $SHAPE ${TINY:+--tiny}"
stage $G --stages generation --engines hf,generate,static:eager,static:${SM:-graphs}  # generate: TRL's path (issue 41, item 3)
grep -q '"mode": "graphs"' $GC/gpu_check.jsonl 2>/dev/null || { [ "$DEV" = cuda ] && SM=eager && echo "=== graphs failed: eager from here"; }
stage $PY scripts/benchmarks/bench.py --model $GC/random-$SHAPE --vs trl --device $DEV --dtype ${DTYPE:-bf16} --algo grpo \
  --prompts ${P:-8} --group ${GRP:-8} --max-new ${NEW:-256} --micro-batch ${MB:-16} --steps 3 --warmup 1 \
  --set rollout.engine=static --set rollout.static.mode=${SM:-graphs} --out $BE
stage $G --stages eos_generation --engines static:${SM:-graphs}  # real lengths: EOS at recorded lengths (issue 41)
stage $PY scripts/benchmarks/bench.py --model $GC/random-$SHAPE --vs trl --device $DEV --dtype ${DTYPE:-bf16} --algo grpo \
  --prompts ${P:-8} --group ${GRP:-8} --max-new ${NEW:-256} --micro-batch ${MB:-16} --steps 3 --warmup 1 \
  --eos-lengths reasoning --set rollout.engine=static --set rollout.static.mode=${SM:-graphs} --out $BE/eos
stage $G --stages ref_http
stage $G --stages step_256,step_rm --step-engine static:${SM:-graphs}
stage $G --stages generation --engines static:${CM:-compile+graphs}:0
stage $G --stages generation --engines static:${CM:-compile+graphs}:64:dynamic  # one compile for every bucket (issue 41, item 1)
stage $G --stages step_1024 --step-engine static:${SM:-graphs}
B="$PY scripts/benchmarks/bench.py --model $GC/random-$SHAPE --device $DEV --dtype ${DTYPE:-bf16} --algo grpo --prompts ${P:-8} --group ${GRP:-8} --micro-batch ${MB:-16} --set rollout.engine=static --set rollout.static.mode=${SM:-graphs}"
stage $B --vs trl --max-new $(( ${NEW:-256} * 4 )) --steps 2 --warmup 1 --out $BE/1024
stage $B --vs trl --max-new ${NEW:-256} --steps 3 --warmup 1 --set train.optimizer_states=bf16 --out $BE/bf16  # memory at equal precision
stage $G --stages step_256 --step-engine static:${SM:-graphs} --set logging.audit_every=1 --set 'algo.rollout_correction={mode: mask}'  # issue 45: the audit and the correction in the step
stage $PY scripts/benchmarks/gpu_check.py --out $GC --device $DEV --shapes 135m ${TINY:+--tiny} --stages generation,step_256 --engines hf,static:${SM:-graphs} --step-engine static:${SM:-graphs}
stage $G --stages decode_profile --engines hf,generate  # where the hf engine's decode step goes against generate's
kill $COPIER; copy; ls -la $OUT
