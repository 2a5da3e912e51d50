# the step's copy back made by the compact masters' release (the split writes the model weights): the kernel check
# (bit for bit against torch's rounding, timed against torch's copy then the split), a MoE training profile, and
# ours against the plain loop at 4 layers
python bench/gpu_master_weights_check.py --model Qwen3-30B-A3B --layers 4 --out $JOBS/out/mw_moe4.json
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --steps 1 \
  --cases megatron:world1 --profile $JOBS/out/pmoe_w --profile-phase train --out $JOBS/out/pmoe_w.json
python bench/policy_bench.py --model Qwen3-30B-A3B --layers 4 --token-budget 16384 --fsdp-packed-rows 8 --fsdp-forward-rows 32 \
  --steps 4 --cases megatron:world1,fsdp2_loop:world1 --out $JOBS/out/moe4_two.json --markdown $JOBS/out/moe4_two.md
