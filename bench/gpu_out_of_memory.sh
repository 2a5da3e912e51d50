#!/bin/bash
# A GPU out-of-memory on purpose (issue 20): the 1.7B example's DP2 layout on 2 GPUs with one mini-batch
# of 128 rows per rank in one micro-batch and no recompute, far over the card; the run must stop with
# `WorkerOutOfMemory` naming the worker and the keys that fix it. While it runs, py-spy dumps the
# driver's and the Ray workers' stacks every OOM_DUMP_EVERY seconds into $OUT/pyspy.txt (start-up attribution).
# Run after `source bench/device_setup.sh 2`; writes under $OUT.
set -u
OUT=${OUT:-/tmp/out}
MODEL=/tmp/oom_model
RUN=/tmp/gpu_oom
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv"
python - <<'PY'
from pathlib import Path
from example_layouts import scale_example
from gpu_examples import create_model
example = scale_example(Path("examples/megatron/run_qwen3_1.7b_grpo.sh"), Path("/tmp/oomlaunch"), 2)
create_model(example, Path("/tmp/oom_model"), False)
PY
COMMAND=(python -m skyrl_megatron.demo --gpus 2 --model "$MODEL" --out "$RUN" --fresh --steps 1 --ckpt-interval 0
  trainer.use_sample_packing=true trainer.algorithm.use_kl_loss=true trainer.algorithm.kl_loss_coef=0.001
  trainer.policy.megatron_config.max_tokens_per_microbatch=131072
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=null
  trainer.policy.megatron_config.tensor_model_parallel_size=1
  trainer.ref.megatron_config.max_tokens_per_microbatch=8192 trainer.ref.megatron_config.tensor_model_parallel_size=1
  trainer.hf_save_interval=-1 generator.sampling_params.max_generate_length=512
  generator.n_samples_per_prompt=32 trainer.policy_mini_batch_size=8)
echo "${COMMAND[*]}" > "$OUT/command.txt"
START=$(date +%s)
timeout ${OOM_RUN_TIMEOUT:-480} "${COMMAND[@]}" > "$OUT/run.log" 2>&1 &
DEMO=$!
bash bench/pyspy_watch.sh $DEMO "$OUT/pyspy.txt" ${OOM_DUMP_EVERY:-15} &
wait $DEMO; echo "demo exit code $? after $(( $(date +%s) - START )) s" >> "$OUT/run.log"
cp "$RUN"/*.jsonl "$OUT/" 2>/dev/null
grep -n -E "OutOfMemory|out of memory|max_tokens_per_microbatch|recompute" "$OUT/run.log" | head -20
tail -3 "$OUT/run.log"
