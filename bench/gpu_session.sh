#!/bin/bash
# Issue 18 (and 17's MoE rows) in one device call: the flash_attn stand-in's GPU parity check, then
# policy_bench processes side by side on disjoint GPUs (each starts its own Ray), every job running
# ours and the host's FSDP2 in one process. After call 1 of bench/device_setup.sh, on nvidia-h200-x2:
#
#   source bench/device_setup.sh 2 && bash bench/gpu_session.sh $OUT
#
# S9_JOBS lists one job per line, "GPUS MODEL CASES [policy_bench arguments...]" (GPUS as
# CUDA_VISIBLE_DEVICES). Default: dense Qwen3-1.7B on GPU 0 and Qwen3-4B on GPU 1, each with fsdp2
# (the host's FSDP2 at its best), megatron, and fsdp2_sdpa (host defaults without flash-attn) last:
# the slowest case, and a report is written after every case, so a cut keeps the others. MoE, e.g.:
#
#   S9_JOBS="0 Qwen3-30B-A3B fsdp2:world1,megatron:world1 --layers 8
#   1 Qwen3-30B-A3B fsdp2:world1,megatron:world1@b16k --layers 8"          # EP1 (one GPU each)
#   S9_JOBS="0,1 Qwen3-30B-A3B megatron:ep2,megatron:tp2ep2,fsdp2:dp2 --layers 8"  # two GPUs
#
# Also: BENCH_ARGS (to every job, e.g. "--steps 2"), BENCH_TIMEOUT (seconds per job, default 470:
# with the check, the call ends inside the device's 600 s), S9_CHECK=0 (skip the parity check).
# Files (the device returns at most 8): $OUT/standin.json, $OUT/<model>_<gpus>.json and .png per
# job, $OUT/logs.txt. Render the markdown here later: python bench/policy_bench.py --render J --markdown M
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT_DIR}
MC=trainer.policy.megatron_config
VARIANTS=(
    --variant "b16k=$MC.max_tokens_per_microbatch=16384"
    --variant "rows16=trainer.micro_train_batch_size_per_gpu=16;trainer.micro_forward_batch_size_per_gpu=16"
)
DEFAULT_JOBS="0 Qwen3-1.7B fsdp2:world1,megatron:world1,fsdp2_sdpa:world1
1 Qwen3-4B fsdp2:world1,megatron:world1,fsdp2_sdpa:world1"
LOGS=$(mktemp -d)

if [ "${S9_CHECK:-1}" != 0 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 90 python bench/gpu_flash_attn_standin_check.py --out "$OUT/standin.json" \
        > "$LOGS/0_standin.log" 2>&1
    grep -E "^(FAIL|TIME|flash_attn stand-in|stand-in)" "$LOGS/0_standin.log"
fi

while read -r gpus model cases extra; do
    [ -z "$gpus" ] && continue
    tag="$(echo "$model" | tr 'A-Z.' 'a-z_')_${gpus//,/}"
    # shellcheck disable=SC2086  # extra and BENCH_ARGS are word lists
    CUDA_VISIBLE_DEVICES=$gpus timeout "${BENCH_TIMEOUT:-470}" python bench/policy_bench.py --model "$model" \
        --cases "$cases" "${VARIANTS[@]}" ${extra:-} ${BENCH_ARGS:-} \
        --out "$OUT/$tag.json" --chart "$OUT/$tag.png" > "$LOGS/$tag.log" 2>&1 &
done <<< "${S9_JOBS:-$DEFAULT_JOBS}"
wait
for log in "$LOGS"/*.log; do
    echo "=== $(basename "$log")"
    grep -v -i -E "warn|^\s*$" "$log" | tail -n 200
done > "$OUT/logs.txt"
for log in "$LOGS"/*.log; do
    [ "$(basename "$log")" = 0_standin.log ] && continue
    echo "=== $(basename "$log" .log)"
    grep -h -E "FAILED|^(Micro-batches|\`megatron\`)|^\| |^- megatron" "$log" | grep -v "^|---"
done
