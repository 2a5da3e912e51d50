# a short budget's order: the pass's GPU check, then ours with compact adam first and last around the defaults beside
# the plain loop (the host's FSDP2 left out for time), MoE then dense; a MoE training profile of compact adam last
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_compact_adam_check.py --model Qwen3-30B-A3B --layers 2 --steps 5 --out $JOBS/out/ca_moe2.json
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
A='trainer.policy.megatron_config.compact_adam=true'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1@cadam,megatron:world1,fsdp2_loop:world1,megatron:world1@cadam2 \
  --variant cadam="$A" --variant cadam2="$A" --out $JOBS/out/moe${LAYERS}_cadam.json --markdown $JOBS/out/moe${LAYERS}_cadam.md
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 \
  --cases megatron:world1@cadam,megatron:world1,fsdp2_loop:world1,megatron:world1@cadam2 \
  --variant cadam="$A" --variant cadam2="$A" --out $JOBS/out/dense17_cadam.json --markdown $JOBS/out/dense17_cadam.md
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --steps 1 \
  --cases megatron:world1@cadam --variant cadam="$A" --profile $JOBS/out/pmoe_cadam --profile-phase train \
  --out $JOBS/out/pmoe_cadam.json
