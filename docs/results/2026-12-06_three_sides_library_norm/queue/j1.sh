# disk/memory monitor, then the kernel checks (seconds each)
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
git log -1 --format=%h 2>/dev/null; cat .tree 2>/dev/null
python bench/gpu_fusion_check.py --out $JOBS/out/fusions.json > $JOBS/out/fusions.log 2>&1; tail -25 $JOBS/out/fusions.log
python bench/gpu_expert_wgrad.py > $JOBS/out/ewg.jsonl 2>&1; tail -4 $JOBS/out/ewg.jsonl
