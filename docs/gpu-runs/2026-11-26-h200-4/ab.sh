#!/usr/bin/env bash
# A/B of issue 21 point 4: 8a36640 (8.9 s a step on an H100) against f5d55a8 (22-32 s), then HEAD, one YAML for all:
# grpo with beta 0.04 (in-process reference), bf16, 8 prompts x G 8, 256 new tokens with EOS ignored, micro-batch 16,
# the 1.7B shape with random weights, 40-word prompts. Each commit is its own source tree; each run is one rank (torchrun).
#   MODEL=/tmp/gc/random-1.7b STEPS=4 NEW=256 bash .gpurun/ab/ab.sh /tmp/ab-out
# Each commit's tree: git archive --format=tar C -- algos grpo rewards train.py ref_client.py pyproject.toml > .gpurun/ab/C.tar
set -u
OUTD=${1:-/tmp/ab-out}; MODEL=${MODEL:?}; STEPS=${STEPS:-4}; NEW=${NEW:-256}; ROWS=${ROWS:-8}; MB=${MB:-16}
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
mkdir -p "$OUTD"
python3 - "$OUTD/prompts.jsonl" <<'PY'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for i in range(64):
        f.write(json.dumps({"prompt": " ".join(f"t{random.randrange(4, 4000)}" for _ in range(40)), "answer": "7"}) + "\n")
PY
cat > "$OUTD/ab.yaml" <<YAML
model: {name_or_path: $MODEL, dtype: bf16}
data: {source: jsonl, path: $OUTD/prompts.jsonl}
rollout: {num_generations: 8, prompts_per_step: $ROWS, max_prompt_length: 64, max_completion_length: $NEW, ignore_eos: true, temperature: 1.0}
algo: {name: grpo, beta: 0.04}
train: {max_steps: $STEPS, lr: 1.0e-6, micro_batch_size: $MB, output_dir: OUTDIR, save_every: 0}
logging: {log_every: 1, progress_bar: false, plot: false}
rewards: [{fn: math_correct, kwargs: {extract: last_number, gold: plain}}]
YAML
for c in ${COMMITS:-8a36640 f5d55a8 HEAD}; do
  if [ "$c" = HEAD ]; then src=$REPO; else src=$OUTD/src-$c; mkdir -p "$src"; tar -xf "$HERE/$c.tar" -C "$src"; fi
  run=$OUTD/run-$c; rm -rf "$run"; mkdir -p "$run"
  sed "s#OUTDIR#$run#" "$OUTD/ab.yaml" > "$run/config.yaml"
  echo "=== $c: $(date +%T)"
  (cd "$src" && PYTHONPATH=$src:${PYTHONPATH:-} python3 train.py --config "$run/config.yaml" --print-config > "$run/resolved.yaml" 2>&1)
  t0=$(date +%s)
  # the run is stopped once its last step is logged: the final checkpoint of a 1.7B model would take minutes and 20 GB
  (cd "$src" && PYTHONPATH=$src:${PYTHONPATH:-} exec setsid torchrun --nproc_per_node 1 --master_port 29611 train.py --config "$run/config.yaml" ${OVERRIDES:-}) > "$run/log.txt" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    [ "$(cat "$run/metrics.jsonl" 2>/dev/null | wc -l)" -ge "$STEPS" ] && { sleep 1; kill -- -$pid 2>/dev/null; sleep 2; kill -9 -- -$pid 2>/dev/null; break; }
    sleep 0.5
  done
  wait $pid; echo "=== $c: rc $? in $(( $(date +%s) - t0 )) s"; grep -v "^ *warnings\|forward_call\|shards" "$run/log.txt" | tail -4
  rm -rf "$run/checkpoints" "$run/final"
  python3 - "$c" "$run/metrics.jsonl" <<'PY' | tee -a "$OUTD/ab.md"
import json, statistics, sys
c, path = sys.argv[1], sys.argv[2]
try:
    rows = [json.loads(l) for l in open(path) if l.strip()]
except FileNotFoundError:
    print(f"| {c} | no metrics |"); sys.exit()
rows = rows[1:] or rows  # the first step compiles and warms up
keys = sorted({k for r in rows for k in r if k.startswith("time/") or k.startswith("memory/")} | {"tokens_per_sec"})
med = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
print(f"| {c} | {len(rows)} steps after the first | " + ", ".join(f"{k} {v:.3g}" for k, v in med.items()) + " |")
every = [json.loads(l).get("time/step", float("nan")) for l in open(path) if l.strip()]
print(f"| {c} | time/step of every step | " + ", ".join(f"{t:.2f}" for t in every) + " |")
PY
done
