#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3-30B-A3B (MoE, 128 experts) on one node: experts spread over the 8 GPUs
# (EP 8), attention and embeddings data parallel, full activation recompute; vLLM generation and the
# reference model colocated with the policy.
#
# Hardware: 1 node x 8 H200 (141 GiB each). On 80 GiB GPUs use run_qwen3_30b_a3b_4nodes.sh, or keep this
#   layout with Megatron's optimizer CPU offload (optimizer_config_kwargs: optimizer_cpu_offload=true,
#   optimizer_offload_fraction=1.0; not yet tried with this plugin). The plan command below with
#   --optimizer-offload-fraction 1.0 --gpu-memory-gib 80 shows the fit.
# Host memory: colocation offloads the policy's params, grads and optimizer state (about 70 GiB per GPU,
#   560 GiB per node) to pinned CPU memory while vLLM generates.
# Data: GSM8K as the host's parquet files, e.g. from SkyRL's examples/gsm8k/gsm8k_dataset.py.
# Usage: MODEL_PATH=/ckpt/Qwen3-30B-A3B DATA_DIR=$HOME/data/gsm8k bash examples/megatron/run_qwen3_30b_a3b_1node.sh [key=value ...]
#
# Memory plan of one training step per GPU (the policy; generation and the reference take turns with it):
#   $ skyrl-megatron plan --model examples/megatron/model_configs/Qwen3-30B-A3B.json --nodes 1 --gpus-per-node 8 --ep 8 --etp 1 --micro-batch-tokens 8192 --recompute full --gpu-memory-gib 141
#   model       Qwen3-30B-A3B (qwen3_moe): 30.53B parameters, 3.35B active per token
#               48 layers (48 MoE: 128 experts, 8 per token), hidden 2048, 32/4 q/kv heads, vocab 151936
#   layout      8 GPUs (1 x 8): TP 1, PP 1, CP 1, DP 8 | experts: EP 8, ETP 1, expert-DP 1
#   training    8192 tokens per micro-batch (packed), recompute full, fused SwiGLU, full fine-tune
#               bf16 params, fp32 grads, compact main params (bf16 + 16-bit remainder between steps) + Adam stepping them in place (distributed)
#
#   per GPU
#     params          9.62 GiB  5.16B parameters, bf16
#     grads          19.24 GiB  main_grad buffers of the trainable parameters
#     optimizer      35.54 GiB  compact main params + Adam m, v; dense / 8 (DP x CP), experts / 1 (expert-DP)
#     activations     1.50 GiB  saved for backward: 48 layers x 1 micro-batch in flight
#     transient       2.38 GiB  largest backward transient: logprob head
#     opt. step       0.44 GiB  the step's temporaries over the shard; peaks apart from the two above
#     overhead        3.00 GiB  CUDA context, cuBLAS/NCCL workspaces (fixed allowance)
#     total          71.29 GiB  fits 141 GiB (limit 126.90 GiB at 90% usable)
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
CKPT_DIR=${CKPT_DIR:-$HOME/ckpts/qwen3_30b_a3b_grpo_1node}
NUM_NODES=1
GPUS_PER_NODE=8
TP=1
EP=8                     # 16 of the 128 experts per GPU
ETP=1                    # each expert whole on one GPU
TOKENS_PER_MICROBATCH=8192
NUM_ENGINES=4            # 4 vLLM engines x TP 2 = the 8 GPUs (colocate_all)
ENGINE_TP=2

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
  trainer.policy.megatron_config.expert_model_parallel_size=$EP \
  trainer.policy.megatron_config.expert_tensor_parallel_size=$ETP \
  trainer.policy.megatron_config.max_tokens_per_microbatch=$TOKENS_PER_MICROBATCH \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=full \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_method=uniform \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_num_layers=1 \
  trainer.ref.megatron_config.tensor_model_parallel_size=$TP \
  trainer.ref.megatron_config.expert_model_parallel_size=$EP \
  trainer.ref.megatron_config.expert_tensor_parallel_size=$ETP \
  trainer.ref.megatron_config.max_tokens_per_microbatch=$TOKENS_PER_MICROBATCH \
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
  trainer.run_name=qwen3_30b_a3b_grpo_tp${TP}_ep${EP} \
  "$@"
