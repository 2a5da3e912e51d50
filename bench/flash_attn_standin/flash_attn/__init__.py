"""A stand-in for flash-attn 2.8.3 on machines where it has no build for the installed PyTorch.

The attention functions run PyTorch's own FlashAttention-2 kernels (`flash_attn_interface.py`);
`bert_padding` and `ops/triton/cross_entropy.py` are flash-attn's own pure-Python files, copied in
unchanged by `bench/flash_attn_standin/assemble.py`, which also writes the `flash-attn` 2.8.3
distribution metadata that transformers looks for before it offers `flash_attention_2`.
"""

__version__ = "2.8.3"

from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
