#!/bin/bash
# Issue 6 on a 4-GPU machine: three policy_bench processes side by side on disjoint GPUs (each
# starts its own Ray), our path and the host's FSDP2 path in each, and one profiled step of our
# single-GPU cases (FSDP2's steps are long enough to make a profile slow to summarise). Run after
# `source bench/device_setup.sh 2` in the same device call:
#
#   source bench/device_setup.sh 2 && bash bench/gpu_session.sh $OUT
#
# The device tool returns at most 8 files: 3 reports, 2 profiles and one log.
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR}
BENCH="timeout ${BENCH_TIMEOUT:-560} python bench/policy_bench.py"
# the host's FSDP2 case first in each process: it is the baseline every figure is compared with
CASES_GPU0=${CASES_GPU0:-fsdp2:world1,megatron:world1,megatron:world1@b16k}
CASES_GPU1=${CASES_GPU1:-fsdp2:world1,megatron:world1}
CASES_GPU23=${CASES_GPU23:-fsdp2:dp2,megatron:dp2,megatron:tp2}
B16K="--variant b16k=trainer.policy.megatron_config.max_tokens_per_microbatch=16384"
LOGS=$(mktemp -d)
CUDA_VISIBLE_DEVICES=0 $BENCH --model Qwen3-1.7B --cases "$CASES_GPU0" $B16K \
    --profile "$OUT/p17" --profile-backends megatron --out "$OUT/b17.json" > "$LOGS/b17.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 $BENCH --model Qwen3-4B --cases "$CASES_GPU1" $B16K \
    --profile "$OUT/p4" --profile-backends megatron --out "$OUT/b4.json" > "$LOGS/b4.log" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 $BENCH --model Qwen3-1.7B --cases "$CASES_GPU23" $B16K \
    --out "$OUT/b17x2.json" > "$LOGS/b17x2.log" 2>&1 &
wait
for log in "$LOGS"/*.log; do
    echo "=== $(basename "$log")"
    grep -v -i -E "warn|^\s*$" "$log" | tail -n 400
done > "$OUT/logs.txt"
grep -h -E " step |FAILED|profiled step|^\| " "$LOGS"/*.log
