# ours only, the other order (the defaults first, `@shared` after), then a training profile of the MoE defaults
S='trainer.placement.colocate_policy_ref=true'
python bench/policy_bench.py --model Qwen3-1.7B --steps 3 --cases megatron:world1,megatron:world1@shared \
  --variant shared="$S" --out $JOBS/out/dense_rev.json --markdown $JOBS/out/dense_rev.md
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --steps 1 \
  --cases megatron:world1 --profile $JOBS/out/pmoe --profile-phase train --out $JOBS/out/pmoe.json
