# dense three sides (Qwen3-4B on a 141 GB card, Qwen3-1.7B on 80 GB) with the two-kernel head (`@two`, the defaults
# before lse_gemm) first and last around the defaults
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MODEL=Qwen3-4B; ROWS=16; [ "$MEM" -gt 100000 ] || { MODEL=Qwen3-1.7B; ROWS=32; }
K='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs]'
python bench/policy_bench.py --model $MODEL --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows $ROWS \
  --cases megatron:world1@two,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@two2 \
  --variant two="$K" --variant two2="$K" --out $JOBS/out/dense_three.json --markdown $JOBS/out/dense_three.md
