# dense: Qwen3-1.7B three sides with compact adam first and last (the 4B on a 141 GB card as well)
A='trainer.policy.megatron_config.compact_adam=true'
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 \
  --cases megatron:world1@cadam,megatron:world1,fsdp2:world1,fsdp2_loop:world1,megatron:world1@cadam2 \
  --variant cadam="$A" --variant cadam2="$A" --out $JOBS/out/dense17_three.json --markdown $JOBS/out/dense17_three.md
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$MEM" -gt 100000 ]; then
  python bench/policy_bench.py --model Qwen3-4B --steps 3 --fsdp-packed-rows 4 --fsdp-forward-rows 16 \
    --cases megatron:world1@cadam,megatron:world1,fsdp2_loop:world1 --variant cadam="$A" \
    --out $JOBS/out/q4b_cadam.json --markdown $JOBS/out/q4b_cadam.md
fi
