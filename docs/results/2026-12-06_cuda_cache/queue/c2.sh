# MoE three sides (Qwen3-30B-A3B widths, EP1; 8 layers on a 141 GB card, 4 on 80 GB), `@shared` as in c1.sh
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=8; [ "$MEM" -gt 100000 ] || LAYERS=4
S='trainer.placement.colocate_policy_ref=true'
python bench/policy_bench.py --model Qwen3-30B-A3B --layers $LAYERS --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1@shared,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@shared2 \
  --variant shared="$S" --variant shared2="$S" --out $JOBS/out/moe${LAYERS}_three.json --markdown $JOBS/out/moe${LAYERS}_three.md
