#!/bin/bash
# Issue 6 on a multi-GPU machine: policy_bench processes side by side on disjoint GPUs (each starts
# its own Ray), the host's FSDP2 path and ours in one process wherever a ratio is published. Run
# after `source bench/device_setup.sh 2` in the same device call:
#
#   source bench/device_setup.sh 2 && bash bench/gpu_session.sh $OUT
#
# BENCH_JOBS lists one job per line, "GPUS MODEL CASES [profile]" (GPUS as CUDA_VISIBLE_DEVICES);
# the default is session 6's run. Every variant below is defined for every job. Reports go to
# $OUT/<model>_<gpus>.json, profiles of our cases to $OUT/p_<model>_<gpus>/, logs to $OUT/logs.txt
# (the device tool returns at most 8 files).
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR}
BENCH="timeout ${BENCH_TIMEOUT:-560} python bench/policy_bench.py ${BENCH_ARGS:-}"
MC=trainer.policy.megatron_config
VARIANTS=(
    --variant "b16k=$MC.max_tokens_per_microbatch=16384"
    --variant "eager=$MC.fused_kernels=[]"
    --variant "norm=$MC.fused_kernels=[rms_norm]"
    --variant "all=$MC.fused_kernels=[rms_norm,rope,swiglu,logprobs]"
    --variant "rope=$MC.fused_kernels=[rope]"
    --variant "swiglu=$MC.fused_kernels=[swiglu]"
    --variant "rs=$MC.fused_kernels=[rope,swiglu]"  # session 7's default: no logprob-head kernels
    --variant "seg=env:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
DEFAULT_JOBS="0 Qwen3-1.7B fsdp2:world1,megatron:world1,megatron:world1@b16k profile
1 Qwen3-4B fsdp2:world1,megatron:world1 profile
2,3 Qwen3-1.7B fsdp2:dp2,megatron:dp2,megatron:tp2"
LOGS=$(mktemp -d)
while read -r gpus model cases profile; do
    [ -z "$gpus" ] && continue
    tag="${model,,}_${gpus//,/}"
    extra=()
    [ "${profile:-}" = profile ] && extra=(--profile "$OUT/p_$tag" --profile-backends megatron)
    CUDA_VISIBLE_DEVICES=$gpus $BENCH --model "$model" --cases "$cases" "${VARIANTS[@]}" "${extra[@]}" \
        --out "$OUT/$tag.json" > "$LOGS/$tag.log" 2>&1 &
done <<< "${BENCH_JOBS:-$DEFAULT_JOBS}"
wait
for log in "$LOGS"/*.log; do
    echo "=== $(basename "$log")"
    grep -v -i -E "warn|^\s*$" "$log" | tail -n 300
done > "$OUT/logs.txt"
grep -h -E " step |FAILED|profiled step|^\| " "$LOGS"/*.log
