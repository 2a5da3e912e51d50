# disk/memory monitor; quack's varlen-M GEMM for the experts' forward and input gradient alone (seconds; not yet run on an H200)
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_expert_gemm.py > $JOBS/out/egemm.jsonl 2>&1; tail -6 $JOBS/out/egemm.jsonl
