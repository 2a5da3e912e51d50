# The experts' weight-gradient GEMM with the configurations pinned in expert_wgrad.PINNED_CONFIGS (against quack's default
# and autotuned ones) and compact adam's pass (its tie bits now int16 words) against its definition first; then the
# three sides with today's defaults (swiglu_gemm on, the pinned configurations) in one invocation each: the MoE widths
# at 4 layers (ours first and last around the plain FSDP2 loop, the host's FSDP2 worker after them), then Qwen3-1.7B
# (ours first and last around both FSDP2 sides; both fit 80 GB); quack's autotuned SwiGLU GEMMs against its default
# configuration last
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_expert_wgrad.py > $JOBS/out/ewg.jsonl 2>&1
python bench/gpu_compact_adam_check.py --model Qwen3-1.7B --steps 3 --out $JOBS/out/ca_dense17.json > $JOBS/out/ca_dense17.log 2>&1
A='trainer.policy.megatron_config.compact_adam=auto'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --fsdp-packed-rows 8 \
  --fsdp-forward-rows 32 --steps 4 --cases megatron:world1,fsdp2_loop:world1,megatron:world1@again,fsdp2:world1 \
  --variant again="$A" --out $JOBS/out/moe4_three.json --markdown $JOBS/out/moe4_three.md
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 32 \
  --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@again --variant again="$A" \
  --out $JOBS/out/dense17_three.json --markdown $JOBS/out/dense17_three.md
python bench/gpu_swiglu_gemm.py --tuned --shapes 23057:2048:6144,23057:2560:9728 > $JOBS/out/swiglu_gemm_tuned.jsonl 2>&1
