# dense 1.7B three sides on an H200 (on an H100 it ran as job 2)
R='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,rms_norm]'
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] || { echo "ran as job 2"; exit 0; }
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-forward-rows 32 \
  --cases megatron:world1@rmsn,megatron:world1,fsdp2:world1,fsdp2_loop:world1 --variant rmsn="$R" \
  --out $JOBS/out/d17b_three.json --markdown $JOBS/out/d17b_three.md
