"""HF checkpoints to Megatron chunks and back: Megatron-Bridge imported without Transformer Engine
(`bridge_import.py`), the HF checkpoint's tensors read for its conversion from shards opened once
(`hf_tensors.py`), and the conversion cache that keeps each converted checkpoint as a Megatron
distributed checkpoint keyed by its content (`cache.py`), so a model is converted once per machine."""
