# fc1 with the SwiGLU in one GEMM (swiglu_gemm, the default) end to end: the kernel check, then the dense three sides
# with `@two` (the defaults without swiglu_gemm: fc1, then the SwiGLU kernel) first and last around the defaults;
# Qwen3-4B on a 141 GB card, Qwen3-1.7B on 80 GB (and the 1.7B as well on 141 GB); a scoring profile of the 1.7B
# defaults; on a 141 GB card last the MoE widths at 8 layers, ours first and last (no dense MLP: swiglu_gemm not taken)
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_swiglu_gemm.py > $JOBS/out/swiglu_gemm.jsonl 2>&1
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MODEL=Qwen3-4B; ROWS=16; [ "$MEM" -gt 100000 ] || { MODEL=Qwen3-1.7B; ROWS=32; }
T='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,lse_gemm]'
python bench/policy_bench.py --model $MODEL --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows $ROWS \
  --cases megatron:world1@two,megatron:world1,fsdp2_loop:world1,fsdp2:world1,megatron:world1@two2 \
  --variant two="$T" --variant two2="$T" --out $JOBS/out/dense_sgemm.json --markdown $JOBS/out/dense_sgemm.md
[ "$MEM" -gt 100000 ] && python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
  --cases megatron:world1@two,megatron:world1,fsdp2_loop:world1,fsdp2:world1,megatron:world1@two2 \
  --variant two="$T" --variant two2="$T" --out $JOBS/out/dense17_sgemm.json --markdown $JOBS/out/dense17_sgemm.md
true
python bench/policy_bench.py --model Qwen3-1.7B --steps 1 --cases megatron:world1 \
  --profile $JOBS/out/p17f --profile-phase forward --out $JOBS/out/p17f.json
A='trainer.policy.megatron_config.compact_adam=auto'
[ "$MEM" -gt 100000 ] && python bench/policy_bench.py --model Qwen3-30B-A3B --layers 8 --token-budget 16384 --fsdp-packed-rows 8 \
  --fsdp-forward-rows 32 --steps 4 --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@again \
  --variant again="$A" --out $JOBS/out/moe8_three.json --markdown $JOBS/out/moe8_three.md
true
