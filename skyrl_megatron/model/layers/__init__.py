"""The TE-free dense layers of our block spec and their kernels: core attention over padded, packed (THD)
and context-parallel micro-batches (`attention.py`, with the load-balanced CP layout of
`context_parallel_layout.py`), RMSNorm (`norm.py`), RoPE (`rope.py`) and the fused query/key norm with
rotation (`qk_norm_rope.py` over `norm_rope_kernels.py`), the dense MLP's SwiGLU (`swiglu.py` over
`swiglu_kernels.py`) and its fc1 GEMM with the SwiGLU in the epilogue for forward-only passes (`mlp.py` over
`swiglu_gemm.py`, told by `forward_only.py`), the switch for generated kernels (`fusions.py`) and weight-gradient GEMMs that
accumulate into DDP's `main_grad` (`wgrad.py`)."""
