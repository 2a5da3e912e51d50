# disk/memory monitor; dense three sides (Qwen3-1.7B on 80 GB, Qwen3-4B on 141 GB): the defaults (the CUDA cache kept
# between passes on GPUs of the worker's own) against `@shared` (a placement that shares the GPUs: emptied as the host asks), first and last
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MODEL=Qwen3-4B; ROWS=16; [ "$MEM" -gt 100000 ] || { MODEL=Qwen3-1.7B; ROWS=32; }
S='trainer.placement.colocate_policy_ref=true'
python bench/policy_bench.py --model $MODEL --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows $ROWS \
  --cases megatron:world1@shared,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@shared2 \
  --variant shared="$S" --variant shared2="$S" --out $JOBS/out/dense_three.json --markdown $JOBS/out/dense_three.md
