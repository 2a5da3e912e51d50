# The experts' weight-gradient GEMM with the configurations pinned in expert_wgrad.PINNED_CONFIGS and compact adam's pass
# (its tie bits now int16 words) against its definition first; then, on a 141 GB card (an H200), what the H100 run of
# 2026-12-07 14:51 could not reach: the MoE widths at 8 layers, ours first and last beside both FSDP2 sides; Qwen3-4B
# with `@two` (the defaults without swiglu_gemm) first and last around the defaults and `@train` (swiglu_gemm_training
# added), both FSDP2 sides; the 1.7B three sides; quack's autotuned SwiGLU GEMMs against its default configuration last
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_expert_wgrad.py > $JOBS/out/ewg.jsonl 2>&1
python bench/gpu_compact_adam_check.py --model Qwen3-1.7B --steps 3 --out $JOBS/out/ca_dense17.json > $JOBS/out/ca_dense17.log 2>&1
T='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,lse_gemm]'
R='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,swiglu_gemm,swiglu_gemm_training,logprobs,lse_gemm]'
A='trainer.policy.megatron_config.compact_adam=auto'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 8 --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@again --variant again="$A" \
  --out $JOBS/out/moe8_three.json --markdown $JOBS/out/moe8_three.md
python bench/policy_bench.py --model Qwen3-4B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 16 \
  --cases megatron:world1@two,megatron:world1,megatron:world1@train,fsdp2_loop:world1,fsdp2:world1,megatron:world1@two2 \
  --variant two="$T" --variant two2="$T" --variant train="$R" --out $JOBS/out/dense4b_sgemm.json --markdown $JOBS/out/dense4b_sgemm.md
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
  --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@again --variant again="$A" \
  --out $JOBS/out/dense17_three.json --markdown $JOBS/out/dense17_three.md
python bench/gpu_swiglu_gemm.py --tuned --shapes 23057:2048:6144,23057:2560:9728 > $JOBS/out/swiglu_gemm_tuned.jsonl 2>&1
