(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
# kernel checks, seconds each
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_expert_wgrad.py > $JOBS/out/ewg.jsonl 2>&1; cat $JOBS/out/ewg.jsonl | tail -3
python bench/gpu_expert_wgrad.py --hidden 4096 --ffn 1536 --tokens 8192 > $JOBS/out/ewg235.jsonl 2>&1; tail -3 $JOBS/out/ewg235.jsonl
python bench/gpu_row_gather.py > $JOBS/out/row_gather.jsonl 2>&1; tail -5 $JOBS/out/row_gather.jsonl
python bench/gpu_fusion_check.py --out $JOBS/out/fusions.json > $JOBS/out/fusions.log 2>&1; tail -15 $JOBS/out/fusions.log
python bench/gpu_master_weights_check.py --model Qwen3-30B-A3B --layers 4 --out $JOBS/out/mw_moe.json --profile $JOBS/out/mw_moe_profile.txt > $JOBS/out/mw_moe.log 2>&1; tail -8 $JOBS/out/mw_moe.log
