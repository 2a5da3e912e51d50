# disk/memory monitor; the logprob head with its statistics in quack's GEMM epilogue against the two-kernel head
# (errors against fp64, scoring == training bitwise, milliseconds); on a 141 GB card also quack's expert GEMMs alone
(setsid nohup bash -c "while true; do date -u +%T; df -m / | tail -1; free -m | sed -n 2p; nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 30; done" > $JOBS/out/monitor.log 2>&1 < /dev/null &)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
python bench/gpu_lse_gemm.py > $JOBS/out/lse.jsonl 2>&1; tail -8 $JOBS/out/lse.jsonl
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] && { python bench/gpu_expert_gemm.py > $JOBS/out/egemm.jsonl 2>&1; tail -6 $JOBS/out/egemm.jsonl; }
true
