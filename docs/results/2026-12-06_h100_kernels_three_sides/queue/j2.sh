# MoE three sides, 4 layers, EP1: defaults and expert_wgrad
E='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_wgrad]'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 3 --cases megatron:world1,megatron:world1@ewg,fsdp2:world1,fsdp2_loop:world1 \
  --variant ewg="$E" --out $JOBS/out/moe4_three.json --markdown $JOBS/out/moe4_three.md
