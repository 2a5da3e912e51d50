# one H200, the budget's last minutes: Qwen3-4B, ours (the defaults: the head's epilogue GEMM, the CUDA cache kept on a
# GPU of the worker's own) against the plain FSDP2 loop, the host's worker after them where the budget lasts
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/policy_bench.py --model Qwen3-4B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 16 \
  --cases megatron:world1,fsdp2_loop:world1 --out $JOBS/out/q4b_two.json --markdown $JOBS/out/q4b_two.md
python bench/policy_bench.py --model Qwen3-4B --steps 2 --fsdp-packed-rows 4 --fsdp-forward-rows 16 \
  --cases fsdp2:world1 --out $JOBS/out/q4b_host.json --markdown $JOBS/out/q4b_host.md
