# quack's varlen-M GEMM for the experts' forward and input gradient, alone (seconds)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] || { echo "80 GB card: ran on an H100 on 2026-12-06 05:42 UTC"; exit 0; }
python bench/gpu_expert_gemm.py > $JOBS/out/egemm.jsonl 2>&1; tail -6 $JOBS/out/egemm.jsonl
