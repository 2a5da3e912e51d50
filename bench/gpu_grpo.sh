#!/bin/bash
# GRPO through the host trainer on 1 GPU with our workers and our HF engine, killed once
# and resumed: `python -m skyrl_megatron.demo --gpu` (a Qwen3-0.6B-shaped policy, ref and the HF engine
# colocated, CUDA IPC weight sync after every step). Run after `source bench/device_setup.sh 2`.
#   GRPO_STEPS (20), GRPO_KILL_AFTER (8): the step after which the policy workers are SIGKILLed;
#   GRPO_GPUS (1; 2: policy and ref tensor parallel over both GPUs, one engine per GPU);
#   GRPO_CKPT_INTERVAL (5), GRPO_RUN_TIMEOUT (400 s per run), GRPO_LOG_LEVEL (WARNING).
set -u
STEPS=${GRPO_STEPS:-20}
GPUS=${GRPO_GPUS:-1}
KILL_AFTER=${GRPO_KILL_AFTER:-8}
RUN=/tmp/grpo_gpu
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -rf "$RUN"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv"
LOG_LEVEL=${GRPO_LOG_LEVEL:-WARNING} timeout ${GRPO_RUN_TIMEOUT:-400} python -m skyrl_megatron.demo --gpus $GPUS --out "$RUN" --steps "$STEPS" --ckpt-interval ${GRPO_CKPT_INTERVAL:-5} > "$OUT/run1.log" 2>&1 &
DEMO=$!
while kill -0 $DEMO 2>/dev/null; do
  if [ -f "$RUN/metrics.jsonl" ] && python - "$RUN/metrics.jsonl" "$KILL_AFTER" <<'PY'
import json, sys
steps = [json.loads(l).get("step") for l in open(sys.argv[1]) if "trainer/global_step" in l]
sys.exit(0 if int(sys.argv[2]) in steps else 1)
PY
  then
    nvidia-smi --query-gpu=index,memory.used --format=csv > "$OUT/gpu_memory_at_kill.csv"
    pkill -9 -f "ray::MegatronPolicyWorker" && echo "killed a policy worker after step $KILL_AFTER" >> "$OUT/run1.log"
    break
  fi
  sleep 2
done
wait $DEMO; echo "first run exit code $?" >> "$OUT/run1.log"
LOG_LEVEL=${GRPO_LOG_LEVEL:-WARNING} timeout ${GRPO_RUN_TIMEOUT:-400} python -m skyrl_megatron.demo --gpus $GPUS --out "$RUN" --steps "$STEPS" --ckpt-interval ${GRPO_CKPT_INTERVAL:-5} > "$OUT/run2.log" 2>&1
echo "second run exit code $?" >> "$OUT/run2.log"
cp "$RUN/metrics.jsonl" "$RUN/reward.png" "$OUT/" 2>/dev/null
ls -lR "$RUN/exports" > "$OUT/exports.txt" 2>&1
python bench/grpo_report.py "$RUN/metrics.jsonl" > "$OUT/report.md" 2>&1
tail -5 "$OUT/report.md"
