#!/usr/bin/env bash
# The next GPU session's run of issue 41 (and 45's figures), in the order the H100 session of 2026-11-27 left it
# (docs/results.md): every stage under what is left of BUDGET seconds, results copied to $OUT every 3 s.
#   BUDGET=545 OUT=/tmp/out bash scripts/benchmarks/gpu_session.sh                       # on the GPU machine (needs trl)
#   OUT=/tmp/o DEV=cpu SHAPE=tiny TINY=1 DTYPE=fp32 STATES=fp32 SM=eager CM=compile P=2 GRP=2 NEW=8 MB=4 bash scripts/benchmarks/gpu_session.sh
# Env: SHAPE (1.7b), DEV (cuda), DTYPE (bf16), STATES (optimizer states of the benches: bf16, TRL's too), SM (static
# mode of the steps: graphs), CM (compiled mode tried: compile+graphs), P / GRP / NEW / MB (bench: prompts, G, new
# tokens, micro-batch), PY (python3), SKIP (skip the first SKIP stages: a second call goes on where the log of the
# first says it stopped; the stages take about 16 minutes on an H100, a call at most 10).
SHAPE=${SHAPE:-1.7b}; BUDGET=${BUDGET:-560}; DEV=${DEV:-cuda}; PY=${PY:-python3}; SM=${SM:-graphs}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1
GC=/tmp/gc; BE=/tmp/bench; mkdir -p $GC $BE $OUT
copy() {
  cp $GC/gpu_check.jsonl $GC/gpu_table.md $OUT/ 2>/dev/null
  for f in $BE/*/bench-*.json; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"; done
}
( while sleep 3; do copy; done ) &
COPIER=$!
N=0
stage() { local l; l=$(left); N=$((N + 1)); [ "$N" -gt "${SKIP:-0}" ] || { echo "=== stage $N skipped (SKIP)"; return; }
  echo "=== stage $N [$(( $(date +%s) - T0 ))s, ${l}s left] $*"; [ "$l" -gt 20 ] || { echo "skipped: no time"; return; }
  timeout -k 5 "$l" "$@"; echo "=== rc $? after $(( $(date +%s) - T0 ))s"; }
GPU_TESTS="logprob_gap or gemma2-graphs or qwen3_5-graphs or gemma4-graphs or gemma3n-graphs or llama4-graphs or mistral4-graphs"
G="$PY scripts/benchmarks/gpu_check.py --out $GC --device $DEV --shapes $SHAPE ${TINY:+--tiny} --optimizer-states ${STATES:-bf16}"
B="$PY scripts/benchmarks/bench.py --model $GC/random-$SHAPE --device $DEV --dtype ${DTYPE:-bf16} --algo grpo
   --prompts ${P:-8} --group ${GRP:-8} --max-new ${NEW:-256} --micro-batch ${MB:-16} --steps 3 --warmup 1
   --set rollout.engine=static --set rollout.static.mode=$SM --set train.optimizer_states=${STATES:-bf16}"
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
[ -f $GC/random-$SHAPE/config.json ] || $PY -c "import sys, torch; from pathlib import Path; sys.path.insert(0, '.')
from scripts.benchmarks.bench_ref import random_smollm2; from scripts.benchmarks.gpu_check import SHAPES
random_smollm2(Path('$GC/random-$SHAPE'), SHAPES['$SHAPE'], '$DEV', torch.bfloat16 if '${DTYPE:-bf16}' == 'bf16' else torch.float32)"
# item 2: where our training passes' 1.53 s goes against TRL's 0.78 s (H100), kernel by kernel on both sides, then
# ours phase by phase with MFU
stage $B --vs trl --profile --out $BE/prof
# second (about a minute; `auto` picks the static engine on CUDA for the families added since the H100 session):
# every family's bf16 sampler against the trainer (Gemma 2's: the H100's one failure, fixed in 24115da) and the
# graphed steps of the new families (ids are [KIND-MODE]; tests/test_gpu_session.py checks each -k term selects one)
stage $PY -m pytest -p no:cacheprovider -q -m gpu tests/test_static_engine.py -k "$GPU_TESTS"
# issue 45's one figure left (never reached at the end of the H100's order): the audit on every step and the rollout
# correction, their share of a step (time/audit beside time/step) at 64 x 256
stage $G --stages step_256 --step-engine static:$SM --set logging.audit_every=1 --set 'algo.rollout_correction={mode: mask}'
# item 2 again: our step's phases under the profiler, MFU per phase
stage $G --stages train_profile --step-engine static:$SM
# the same step with the policy's passes in one forward per row (no shared prompt: TRL's shape), and the step
# metrics' memory/*_device_allocs say whether the passes run on a cache the offload emptied
stage $B --out $BE/noshare --set train.share_prompt=false
stage $B --out $BE/cache --set rollout.static.empty_cache=false
# the one step at a new batch width ran 0.8 s slower on the H100 (a per-shape set-up?); real data brings new
# widths every step: 8 steps of prompts drawn at 20-60 words (the last stage's step_256: 40 words each)
stage $G --stages step_256 --step-engine static:$SM --steps 8 --prompt-words 20-60
# item 3: the hf engine and transformers' generate, now with the trainer's one host thread (2026-11-27: 919 and 1,001
# tokens/s with a thread a core, TRL's own generate 2,015 in its trainer), then where each decode step goes
stage $G --stages generation --engines hf,generate,static:$SM
stage $G --stages decode_profile --engines hf,generate
# item 1: graphs kept across the training passes (no recapture: offload off) against the default, step and peak
stage $B --out $BE/keep --set rollout.static.offload=false
stage $B --out $BE/eos-keep --eos-lengths reasoning --set rollout.static.offload=false
# item 4 on both sides: TRL with EOS at the same recorded lengths (cut by the time limit on 2026-11-27)
stage $B --vs trl --eos-lengths reasoning --out $BE/eos
stage $G --stages eos_generation --engines static:$SM,static:$SM@16@4,static:$SM@32@4  # issue 56: slots
# issue 56: streamed rollouts (rollout.max_staleness 1 and 2) against a step at a time, ms a token against EOS ignored
stage $G --stages stream
# item 1: compile warm-up bounded (compile_dynamic) and its tokens/s
stage $G --stages generation --engines static:${CM:-compile+graphs}:64:dynamic
# 1024 tokens against TRL
stage $B --vs trl --max-new $(( ${NEW:-256} * 4 )) --out $BE/1024
kill $COPIER; copy; git log -1 --format=%H > $OUT/commit.txt 2>/dev/null; ls -la $OUT
