"""The installed host's own HF model wrapper on CPU: the logprob reference our parity tests score against."""

from __future__ import annotations

import importlib


def host_hf_model(hf_dir: str):
    """The host's `HFModelWrapper` over `hf_dir` in fp32, in eval mode, runnable on CPU."""
    from skyrl_megatron.activation import activate
    from skyrl_megatron.hosts import current

    activate()  # the host imports flash_attn's padding helpers (flash-attn without its CUDA build here)
    host = current()
    # flash-attn's Triton cross entropy imports without a GPU but cannot run on CPU (0.3.1 takes it
    # whenever it imported; 0.4 only for CUDA logits)
    importlib.import_module(host.torch_utils_module).FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
    wrapper = importlib.import_module(host.hf_model_wrapper_module).HFModelWrapper
    return wrapper(hf_dir, bf16=False).eval()
