#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3-235B-A22B (MoE, 128 experts, 94 layers) on eight nodes: TP 4 (with sequence
# parallelism) inside each node half, every expert whole on one GPU (EP 64: two experts per GPU and
# layer), DP 16 for attention and embeddings, full activation recompute; vLLM generation colocated.
# No KL loss, hence no reference model: a second 235B copy would double the offload traffic.
#
# Hardware: 8 nodes x 8 H200 (141 GiB each), one Ray cluster: `ray start --head` on the first node,
#   `ray start --address=<head-ip>:6379` on the others, then run this script on the head node.
#   MODEL_PATH, DATA_DIR and CKPT_DIR must be visible on every node (a shared file system).
#   On 8 x 8 H100 (80 GiB) `skyrl-megatron plan ... --suggest` finds only TP 4 x PP 2 x CP 2, at the
#   edge of memory: keep the optimizer state on the CPU there (--optimizer-offload-fraction).
# Host memory: colocation offloads the policy's params, grads and optimizer state (about 70 GiB per GPU,
#   560 GiB per node) to pinned CPU memory while vLLM generates.
# Data: GSM8K as the host's parquet files, e.g. from SkyRL's examples/gsm8k/gsm8k_dataset.py.
# Usage: MODEL_PATH=/ckpt/Qwen3-235B-A22B DATA_DIR=$HOME/data/gsm8k bash examples/megatron/run_qwen3_235b_a22b.sh [key=value ...]
#
# Memory plan of one training step per GPU (the policy; generation takes turns with it):
#   $ skyrl-megatron plan --model examples/megatron/model_configs/Qwen3-235B-A22B.json --nodes 8 --gpus-per-node 8 --tp 4 --ep 64 --etp 1 --micro-batch-tokens 8192 --recompute full --gpu-memory-gib 141
#   model       Qwen3-235B-A22B (qwen3_moe): 235.09B parameters, 22.19B active per token
#               94 layers (94 MoE: 128 experts, 8 per token), hidden 4096, 64/4 q/kv heads, vocab 151936
#   layout      64 GPUs (8 x 8): TP 4 + SP, PP 1, CP 1, DP 16 | experts: EP 64, ETP 1, expert-DP 1
#   training    8192 tokens per micro-batch (packed), recompute full, fused SwiGLU, full fine-tune
#               bf16 params, fp32 grads, compact main params (bf16 + 16-bit remainder between steps) + Adam stepping them in place (distributed)
#
#   per GPU
#     params         10.40 GiB  5.59B parameters, bf16
#     grads          20.81 GiB  main_grad buffers of the trainable parameters
#     optimizer      34.23 GiB  compact main params + Adam m, v; dense / 16 (DP x CP), experts / 1 (expert-DP)
#     activations     1.47 GiB  saved for backward: 94 layers x 1 micro-batch in flight
#     transient       0.70 GiB  largest backward transient: logprob head
#     opt. step       0.43 GiB  the step's temporaries over the shard; peaks apart from the two above
#     overhead        3.00 GiB  CUDA context, cuBLAS/NCCL workspaces (fixed allowance)
#     total          70.62 GiB  fits 141 GiB (limit 126.90 GiB at 90% usable)
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-235B-A22B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
CKPT_DIR=${CKPT_DIR:-$HOME/ckpts/qwen3_235b_a22b_grpo}
NUM_NODES=8
GPUS_PER_NODE=8
TP=4                     # the most that 4 KV heads allow
EP=64                    # 2 of the 128 experts per GPU
ETP=1                    # each expert whole on one GPU
TOKENS_PER_MICROBATCH=8192
NUM_ENGINES=8            # 8 vLLM engines x TP 8 (one per node) = the 64 GPUs (colocate_all)
ENGINE_TP=8

skyrl-megatron \
  data.train_data="['$DATA_DIR/train.parquet']" \
  data.val_data="['$DATA_DIR/validation.parquet']" \
  trainer.strategy=megatron \
  trainer.policy.model.path="$MODEL_PATH" \
  trainer.placement.colocate_all=true \
  trainer.placement.policy_num_nodes=$NUM_NODES \
  trainer.placement.policy_num_gpus_per_node=$GPUS_PER_NODE \
  trainer.policy.megatron_config.tensor_model_parallel_size=$TP \
  trainer.policy.megatron_config.expert_model_parallel_size=$EP \
  trainer.policy.megatron_config.expert_tensor_parallel_size=$ETP \
  trainer.policy.megatron_config.max_tokens_per_microbatch=$TOKENS_PER_MICROBATCH \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=full \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_method=uniform \
  trainer.policy.megatron_config.transformer_config_kwargs.recompute_num_layers=1 \
  trainer.use_sample_packing=true \
  trainer.algorithm.advantage_estimator=grpo \
  trainer.algorithm.use_kl_loss=false \
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
  generator.gpu_memory_utilization=0.7 \
  generator.async_engine=true \
  generator.batched=true \
  generator.n_samples_per_prompt=5 \
  generator.sampling_params.max_generate_length=1024 \
  environment.env_class=gsm8k \
  trainer.logger="${LOGGER:-console}" \
  trainer.project_name=gsm8k_megatron \
  trainer.run_name=qwen3_235b_a22b_grpo_tp${TP}_ep${EP} \
  "$@"
