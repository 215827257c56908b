#!/usr/bin/env bash
# Run 1 of the H100 session (2026-11-27): issue 41's generation figures (hf engine against transformers' generate,
# TRL's path; EOS at recorded lengths), the step against TRL at 256 tokens with bf16 optimizer states on both sides,
# where the hf engine's decode step goes; issue 45's audit and correction in the step. Keeps the first half of
# SmolLM2's GGUF for run 2 (the real model; a call carries at most 64 MiB).
#   BUDGET=300 bash docs/gpu-runs/2026-11-27-h100/run1.sh                    (on the GPU machine; carry .whl .gp)
#   OUT=/tmp/o DEV=cpu SHAPE=tiny TINY=1 DTYPE=fp32 STATES=fp32 SM=eager P=2 GRP=2 NEW=8 MB=4 bash docs/gpu-runs/2026-11-27-h100/run1.sh
. docs/gpu-runs/2026-11-27-h100/common.sh
mkdir -p /tmp/keep && cp .gp/part-00 /tmp/keep/ 2>/dev/null; nvidia-smi > $OUT/nvidia-smi.txt 2>&1
stage $G --stages generation --engines hf,generate,static:${SM:-graphs}
stage $G --stages eos_generation --engines static:${SM:-graphs}
stage $B --vs trl --out $BE/b256
stage $G --stages decode_profile --engines hf,generate
stage $G --stages step_256 --step-engine static:${SM:-graphs} --optimizer-states ${STATES:-bf16} --set logging.audit_every=1 --set 'algo.rollout_correction={mode: mask}'
finish
