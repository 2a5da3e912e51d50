# quack's varlen-M GEMM for the experts' forward and input gradient, alone (seconds)
python bench/gpu_expert_gemm.py > $JOBS/out/egemm.jsonl 2>&1; tail -6 $JOBS/out/egemm.jsonl
