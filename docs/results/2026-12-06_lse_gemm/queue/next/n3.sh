# the MoE three sides (Qwen3-30B-A3B widths, EP1; 8 layers on a 141 GB card, 4 on 80 GB): the defaults (quack's expert
# GEMMs, the head's epilogue GEMM), `@torch` (torch._grouped_mm for the experts) and `@two` (the two-kernel head)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
T='trainer.policy.megatron_config.moe_config.expert_gemms=torch'
K='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs]'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1@torch,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@two \
  --variant torch="$T" --variant two="$K" --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
