"""Models: HF checkpoints in through Megatron-Bridge, Megatron modules with our attention spec, HF out."""
