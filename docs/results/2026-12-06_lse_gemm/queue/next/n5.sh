# a training profile of the MoE defaults (8 layers on a 141 GB card)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --steps 1 \
  --cases megatron:world1 --profile $JOBS/out/pmoe --profile-phase train --out $JOBS/out/pmoe.json
