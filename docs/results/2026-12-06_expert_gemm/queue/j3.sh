# training profiles of the MoE with quack's weight gradient, and with all three quack GEMMs
G='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_gemm,expert_wgrad]'
E='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_wgrad]'
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --steps 1 \
  --cases megatron:world1@ewg,megatron:world1@egemm --variant egemm="$G" --variant ewg="$E" \
  --profile $JOBS/out/pmoe --profile-phase train --out $JOBS/out/pmoe.json
