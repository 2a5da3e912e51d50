# MoE three sides (Qwen3-30B-A3B widths, EP1; 8 layers on a 141 GB card, 4 on 80 GB) with compact adam first and last
# around the defaults, then a training profile of compact adam
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
A='trainer.policy.megatron_config.compact_adam=true'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1@cadam,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@cadam2 \
  --variant cadam="$A" --variant cadam2="$A" --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --steps 1 \
  --cases megatron:world1@cadam --variant cadam="$A" --profile $JOBS/out/pmoe_cadam --profile-phase train \
  --out $JOBS/out/pmoe_cadam.json
