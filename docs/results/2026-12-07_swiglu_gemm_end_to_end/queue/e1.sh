# fc1 with the SwiGLU in one GEMM end to end, in the order the budget allows: the kernel checks first (the dense gated
# GEMM, the whole MLP's training pass with swiglu_gemm_training's kernels against Megatron's path, the experts' gated
# varying-M GEMM), then Qwen3-1.7B with `@two` (the defaults without swiglu_gemm: fc1, then the SwiGLU kernel) first,
# the defaults, `@train` (swiglu_gemm_training added), the plain FSDP2 loop and `@two` again; then the MoE widths at 4
# layers (swiglu_gemm on the grouped experts) the same way, the host's worker at 1.7B and a scoring profile last
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_swiglu_gemm.py --shapes 23057:2048:6144,23057:2560:9728 > $JOBS/out/swiglu_gemm.jsonl 2>&1
python bench/gpu_expert_gemm.py --untuned > $JOBS/out/expert_gemm.jsonl 2>&1
T='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,lse_gemm]'
R='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,swiglu_gemm,swiglu_gemm_training,logprobs,lse_gemm]'
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
  --cases megatron:world1@two,megatron:world1,megatron:world1@train,fsdp2_loop:world1,megatron:world1@two2 \
  --variant two="$T" --variant two2="$T" --variant train="$R" \
  --out $JOBS/out/dense17_sgemm.json --markdown $JOBS/out/dense17_sgemm.md
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --fsdp-packed-rows 8 \
  --fsdp-forward-rows 32 --steps 4 --cases megatron:world1@two,megatron:world1,fsdp2_loop:world1,megatron:world1@two2 \
  --variant two="$T" --variant two2="$T" --out $JOBS/out/moe4_sgemm.json --markdown $JOBS/out/moe4_sgemm.md
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
  --cases fsdp2:world1 --out $JOBS/out/dense17_host.json --markdown $JOBS/out/dense17_host.md
python bench/policy_bench.py --model Qwen3-1.7B --steps 1 --cases megatron:world1 \
  --profile $JOBS/out/p17f --profile-phase forward --out $JOBS/out/p17f.json
