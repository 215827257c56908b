#!/usr/bin/env bash
# GPU run 2 of the fourth H200 session (2026-11-26), on the same warm machine right after run 1: the suspect of the
# A/B, ZeRO-3 on one rank, on f5d55a8 and HEAD (HEAD did not finish in the time left).
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
COMMITS="f5d55a8 HEAD" OVERRIDES=train.zero_stage=3 MODEL=/tmp/gc/random-1.7b STEPS=3 timeout 200 bash .gpurun/ab/ab.sh /tmp/ab-z3
