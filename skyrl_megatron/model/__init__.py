"""The model: a Hugging Face checkpoint in as Megatron-Core chunks, trained, and out again under HF names.

`build.py` turns a `ModelSpec` into `BuiltModel` chunks for this rank's process groups, through the
block spec of `layer_spec.py`. Below them, one folder per job: `conversion/` (Megatron-Bridge without
Transformer Engine, the HF tensors it converts and the conversion cache), `layers/` (the TE-free dense
layers and their kernels: attention, norms and RoPE, SwiGLU, fusions, weight-gradient GEMMs, and the
context-parallel layout), `quack_support.py` (what quack-kernels' GEMMs need, read by `layers/`, `moe/` and the
head), `moe/` (MoE settings, the grouped-GEMM experts and the token routing between
ranks and experts) and `adapters/` (what is put on the loaded base: LoRA adapters, the critic's value
head). The folders do not import each other except `adapters/`, which imports the bridge through
`conversion/`; `layers/` and `moe/` read `quack_support.py` beside them.
"""
