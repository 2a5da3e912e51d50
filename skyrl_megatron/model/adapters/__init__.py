"""What `build_model` puts on a loaded base model before DDP wraps it: LoRA adapters through
Megatron-Bridge's PEFT, initialised the same under every layout, with their merged or PEFT export
(`lora.py`), and the critic's value head in place of the LM head (`value_head.py`)."""
