R='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,rms_norm]'
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-forward-rows 32 \
  --cases megatron:world1,megatron:world1@rmsn,fsdp2:world1,fsdp2_loop:world1 \
  --variant rmsn="$R" --out $JOBS/out/d17b_three.json --markdown $JOBS/out/d17b_three.md
