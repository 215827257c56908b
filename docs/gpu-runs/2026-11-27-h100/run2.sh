#!/usr/bin/env bash
# Run 2 of the H100 session (2026-11-27), on the machine run 1 left warm: SmolLM2-135M-Instruct (its GGUF's two
# halves: run 1 kept the first, this call carries the second) learns arithmetic with the reference server as its own
# process on the same GPU, EOS active (issue 41, item 5); the gpu-marked tests; the step against TRL with EOS at
# recorded lengths (item 4).
#   BUDGET=280 bash docs/gpu-runs/2026-11-27-h100/run2.sh                    (on the GPU machine; carry .whl .gpb)
#   OUT=/tmp/o DEV=cpu SHAPE=tiny TINY=1 DTYPE=fp32 STATES=fp32 SM=eager P=2 GRP=2 NEW=8 MB=4 GGUF=/tmp/x.gguf bash docs/gpu-runs/2026-11-27-h100/run2.sh
. docs/gpu-runs/2026-11-27-h100/common.sh
GGUF=${GGUF:-/tmp/keep/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || cat /tmp/keep/part-00 .gpb/part-01 > "$GGUF"
sha256sum "$GGUF" | tee $OUT/gguf.sha256
stage $G --stages real_model --real-model "$GGUF" --real-steps ${REAL_STEPS:-60}
cp -r $GC/real/seed-0/metrics.jsonl $OUT/real-metrics.jsonl 2>/dev/null
[ -n "${TINY:-}" ] || stage $PY -m pytest -p no:cacheprovider -q -m gpu tests/test_static_engine.py tests/test_cuda.py --durations=8
stage $B --vs trl --eos-lengths reasoning --out $BE/eos
finish
