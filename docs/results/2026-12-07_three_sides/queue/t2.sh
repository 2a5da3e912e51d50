# a short budget's cut of t1.sh: today's defaults beside the host's FSDP2 worker at its best and the plain FSDP2 loop,
# one case each, dense (Qwen3-4B on a 141 GB card, Qwen3-1.7B on 80 GB) then the MoE widths (8 layers / 4)
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MODEL=Qwen3-4B; ROWS=16; LAYERS=8; [ "$MEM" -gt 100000 ] || { MODEL=Qwen3-1.7B; ROWS=32; LAYERS=4; }
python bench/policy_bench.py --model $MODEL --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows $ROWS \
  --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1 --out $JOBS/out/dense_three.json --markdown $JOBS/out/dense_three.md
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1 \
  --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
