# dense three sides with the head's epilogue GEMM (`fused_kernels: [..., lse_gemm]`) first and last, the defaults
# between: Qwen3-4B on a 141 GB card, Qwen3-1.7B on an 80 GB one (the host's FSDP2 at 4 packed rows)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MODEL=Qwen3-4B; ROWS=16; [ "$MEM" -gt 100000 ] || { MODEL=Qwen3-1.7B; ROWS=32; }
L='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,lse_gemm]'
python bench/policy_bench.py --model $MODEL --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows $ROWS \
  --cases megatron:world1@lse,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@lse2 \
  --variant lse="$L" --variant lse2="$L" --out $JOBS/out/dense_three.json --markdown $JOBS/out/dense_three.md
