# quack's varlen-M GEMM for the experts' forward and input gradient, alone (seconds; ran on an H100 on 2026-12-06 05:42 UTC)
python bench/gpu_expert_gemm.py > $JOBS/out/egemm.jsonl 2>&1; tail -6 $JOBS/out/egemm.jsonl
