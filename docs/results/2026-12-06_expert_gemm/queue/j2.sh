# MoE three sides (Qwen3-30B-A3B widths, EP1): quack's expert GEMMs (forward, input and weight gradients) and quack's weight gradient alone, first
G='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_gemm,expert_wgrad]'
E='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_wgrad]'
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 3 --cases megatron:world1@egemm,megatron:world1@ewg,megatron:world1,fsdp2:world1,fsdp2_loop:world1 \
  --variant egemm="$G" --variant ewg="$E" --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
