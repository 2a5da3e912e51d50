#!/usr/bin/env bash
# The FSDP2 baseline for run_qwen3_1.7b_grpo.sh: the same model, data, GRPO settings, vLLM generation
# and colocation, trained by the host's own FSDP2 workers (trainer.strategy=fsdp2), to compare step
# times, memory and reward curves with the Megatron run.
#
# Why `skyrl-megatron` and not the host's `python -m skyrl_train.entrypoints.main_base`: skyrl-train
# 0.3.1's FSDP strategy imports MixedPrecisionPolicy from its fsdp_utils, which never defines it, so
# the host's own entry point fails on import. `skyrl-megatron` applies that one fix and leaves
# fsdp/fsdp2 to the host's workers; everything else is the host's code path.
#
# Hardware: 1 node x 8 H100 (80 GiB each), as the Megatron run.
# Usage: MODEL_PATH=/ckpt/Qwen3-1.7B DATA_DIR=$HOME/data/gsm8k bash examples/megatron/run_fsdp_baseline.sh [key=value ...]
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-1.7B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
CKPT_DIR=${CKPT_DIR:-$HOME/ckpts/qwen3_1.7b_grpo_fsdp2}
NUM_NODES=1
GPUS_PER_NODE=8
MICRO_TRAIN_BATCH=4      # FSDP micro-batches count sequences: ~4 x (512 + 1024) tokens
NUM_ENGINES=8
ENGINE_TP=1

skyrl-megatron \
  data.train_data="['$DATA_DIR/train.parquet']" \
  data.val_data="['$DATA_DIR/validation.parquet']" \
  trainer.strategy=fsdp2 \
  trainer.policy.model.path="$MODEL_PATH" \
  trainer.placement.colocate_all=true \
  trainer.placement.policy_num_nodes=$NUM_NODES \
  trainer.placement.policy_num_gpus_per_node=$GPUS_PER_NODE \
  trainer.placement.ref_num_nodes=$NUM_NODES \
  trainer.placement.ref_num_gpus_per_node=$GPUS_PER_NODE \
  trainer.micro_train_batch_size_per_gpu=$MICRO_TRAIN_BATCH \
  trainer.micro_forward_batch_size_per_gpu=$MICRO_TRAIN_BATCH \
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
  trainer.run_name=qwen3_1.7b_grpo_fsdp2 \
  "$@"
