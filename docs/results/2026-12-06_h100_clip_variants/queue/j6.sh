# quack's expert GEMMs against the defaults in the other order (variant first), ours only, 3 measured steps
G='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_gemm,expert_wgrad]'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --steps 3 \
  --cases megatron:world1@egemm,megatron:world1 --variant egemm="$G" --out $JOBS/out/moe4_rev.json --markdown $JOBS/out/moe4_rev.md
