#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3-1.7B: Megatron policy and reference workers, vLLM generation, everything
# colocated on the same GPUs (the idle side is offloaded while the other runs).
#
# Hardware: 1 node x 8 H100 (80 GiB each). Fewer GPUs: lower GPUS_PER_NODE and NUM_ENGINES together.
# Data: GSM8K as the host's parquet files (prompt, env_class=gsm8k, reward_spec), e.g. written by
#   SkyRL's examples/gsm8k/gsm8k_dataset.py --output_dir "$DATA_DIR".
# Usage: MODEL_PATH=/ckpt/Qwen3-1.7B DATA_DIR=$HOME/data/gsm8k bash examples/megatron/run_qwen3_1.7b_grpo.sh [key=value ...]
#
# Memory plan of one training step per GPU (the policy; generation and the reference take turns with it):
#   $ skyrl-megatron plan --model examples/megatron/model_configs/Qwen3-1.7B.json --nodes 1 --gpus-per-node 8 --micro-batch-tokens 8192 --recompute none --gpu-memory-gib 80
#   model       Qwen3-1.7B (qwen3): 1.72B parameters
#               28 layers, hidden 2048, 16/8 q/kv heads, vocab 151936
#   layout      8 GPUs (1 x 8): TP 1, PP 1, CP 1, DP 8
#   training    8192 tokens per micro-batch (packed), recompute none, fused SwiGLU, full fine-tune
#               bf16 params, fp32 grads, compact main params (bf16 + 16-bit remainder between steps) + Adam stepping them in place (distributed)
#
#   per GPU
#     params          3.20 GiB  1.72B parameters, bf16
#     grads           6.41 GiB  main_grad buffers of the trainable parameters
#     optimizer       2.00 GiB  compact main params + Adam m, v; dense / 8 (DP x CP)
#     activations    15.33 GiB  saved for backward: 28 layers x 1 micro-batch in flight
#     transient       2.38 GiB  largest backward transient: logprob head
#     opt. step       0.03 GiB  the step's temporaries over the shard; peaks apart from the two above
#     overhead        3.00 GiB  CUDA context, cuBLAS/NCCL workspaces (fixed allowance)
#     total          32.32 GiB  fits 80 GiB (limit 72.00 GiB at 90% usable)
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-1.7B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
CKPT_DIR=${CKPT_DIR:-$HOME/ckpts/qwen3_1.7b_grpo_megatron}
NUM_NODES=1
GPUS_PER_NODE=8
TP=1                     # 1.7B fits one GPU: all data parallel
TOKENS_PER_MICROBATCH=8192
RECOMPUTE=null           # no activation recompute: it fits (the plan above); skyrl 0.4 would default to full
NUM_ENGINES=8            # vLLM engines x their TP must cover every GPU (colocate_all)
ENGINE_TP=1

skyrl-megatron \
  data.train_data="['$DATA_DIR/train.parquet']" \
  data.val_data="['$DATA_DIR/validation.parquet']" \
  trainer.strategy=megatron \
  trainer.policy.model.path="$MODEL_PATH" \
  trainer.placement.colocate_all=true \
  trainer.placement.policy_num_nodes=$NUM_NODES \
  trainer.placement.policy_num_gpus_per_node=$GPUS_PER_NODE \
  trainer.placement.ref_num_nodes=$NUM_NODES \
  trainer.placement.ref_num_gpus_per_node=$GPUS_PER_NODE \
  trainer.policy.megatron_config.tensor_model_parallel_size=$TP \
  trainer.policy.megatron_config.max_tokens_per_microbatch=$TOKENS_PER_MICROBATCH \
  trainer.ref.megatron_config.tensor_model_parallel_size=$TP \
  trainer.ref.megatron_config.max_tokens_per_microbatch=$TOKENS_PER_MICROBATCH \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=$RECOMPUTE \
  trainer.use_sample_packing=true \
  trainer.algorithm.advantage_estimator=grpo \
  trainer.algorithm.use_kl_loss=true \
  trainer.algorithm.kl_loss_coef=0.001 \
  trainer.policy.optimizer_config.lr=1.0e-6 \
  trainer.epochs=20 \
  trainer.train_batch_size=128 \
  trainer.policy_mini_batch_size=64 \
  trainer.max_prompt_length=512 \
  trainer.eval_batch_size=1024 \
  trainer.eval_before_train=false \
  trainer.eval_interval=5 \
  trainer.ckpt_interval=10 \
  trainer.ckpt_path="$CKPT_DIR" \
  trainer.export_path="$CKPT_DIR/exports" \
  generator.backend=vllm \
  generator.run_engines_locally=true \
  generator.weight_sync_backend=nccl \
  generator.num_inference_engines=$NUM_ENGINES \
  generator.inference_engine_tensor_parallel_size=$ENGINE_TP \
  generator.gpu_memory_utilization=0.6 \
  generator.async_engine=true \
  generator.batched=true \
  generator.n_samples_per_prompt=5 \
  generator.sampling_params.max_generate_length=1024 \
  environment.env_class=gsm8k \
  trainer.logger="${LOGGER:-console}" \
  trainer.project_name=gsm8k_megatron \
  trainer.run_name=qwen3_1.7b_grpo_megatron_tp$TP \
  "$@"
