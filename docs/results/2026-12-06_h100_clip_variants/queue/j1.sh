# disk/memory monitor, then the MoE three sides (Qwen3-30B-A3B widths, EP1): quack's weight-gradient GEMM and the
# compact masters off as variants before the defaults (batches pickled once, the norm read after the update, the clip
# inside fused Adam), quack's forward GEMMs after, then the host's FSDP2 at its best and the plain loop
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
N='trainer.policy.megatron_config.compact_master_weights=false'
E='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_wgrad]'
G='trainer.policy.megatron_config.fused_kernels=[rope,qk_norm_rope,swiglu,logprobs,expert_gemm,expert_wgrad]'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1@ewg,megatron:world1@nocompact,megatron:world1,megatron:world1@egemm,fsdp2:world1,fsdp2_loop:world1 \
  --variant ewg="$E" --variant nocompact="$N" --variant egemm="$G" --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
