# Qwen3-235B-A22B widths on one GPU, three sides at 2 layers (141 GB card only: at 1 layer on 80 GB both FSDP2 sides ran out of memory)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] || { echo "80 GB card: 1 layer ran on an H100 on 2026-12-06 05:42 UTC"; exit 0; }
python bench/policy_bench.py --model Qwen3-235B-A22B --layers 2 --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 2 --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1 --out $JOBS/out/q235_l2.json --markdown $JOBS/out/q235_l2.md
