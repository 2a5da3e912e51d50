# compact adam, alone: today's chain (rebuild, torch's fused AdamW, the release writing the weights) against the one
# pass, at the MoE widths (2 layers: both sides' state fits 80 GB) and at Qwen3-1.7B; bitwise against its definition
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_compact_adam_check.py --model Qwen3-30B-A3B --layers 2 --steps 5 --out $JOBS/out/ca_moe2.json
python bench/gpu_compact_adam_check.py --model Qwen3-1.7B --steps 5 --out $JOBS/out/ca_dense17.json
# the step's host work at 2,107 tensors (tiny widths: the kernels are short, the host's launches are what is timed)
python bench/optimizer_step_host.py --gpu --masters compact --steps 6 > $JOBS/out/host_compact.txt 2>&1
python bench/optimizer_step_host.py --gpu --masters compact_adam --steps 6 > $JOBS/out/host_compact_adam.txt 2>&1
