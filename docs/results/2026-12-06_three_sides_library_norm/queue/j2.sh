# dense three sides, the rms_norm variant first (quack-kernels' RMSNorm where installed)
R='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,rms_norm]'
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$MEM" -gt 100000 ]; then
  python bench/policy_bench.py --model Qwen3-4B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 16 \
    --cases megatron:world1@rmsn,megatron:world1,fsdp2:world1,fsdp2_loop:world1 --variant rmsn="$R" \
    --out $JOBS/out/q4b_three.json --markdown $JOBS/out/q4b_three.md
else
  echo "80 GB card: Qwen3-4B does not fit at the bench's settings; 1.7B with the host's FSDP2 at 4 packed rows"
  python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
    --cases megatron:world1@rmsn,megatron:world1,fsdp2:world1,fsdp2_loop:world1 --variant rmsn="$R" \
    --out $JOBS/out/d17b_three.json --markdown $JOBS/out/d17b_three.md
fi
