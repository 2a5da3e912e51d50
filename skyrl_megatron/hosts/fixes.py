"""Fixes every host release needs on our dependency set (each adapter applies those it needs)."""

from __future__ import annotations

import importlib.util
import sys
import types


def allow_flash_attn_import_without_kernels() -> None:
    """The hosts import `flash_attn` (for its pure-torch padding helpers) at module level.

    Where flash-attn was installed without its compiled CUDA extension (CPU boxes, our GPU machines),
    `import flash_attn` fails on `flash_attn_2_cuda`. We register a placeholder for that extension only:
    the pure-torch helpers import, and any call into a real kernel fails with a clear message.
    """
    if "flash_attn_2_cuda" in sys.modules or importlib.util.find_spec("flash_attn_2_cuda") is not None:
        return
    placeholder = types.ModuleType("flash_attn_2_cuda")

    def _kernel_stub(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(
                f"flash_attn_2_cuda.{name}: flash-attn's CUDA kernels are not built in this environment; "
                "skyrl-megatron does not use them (its attention comes from the Megatron layer spec)"
            )

        return kernel

    placeholder.__getattr__ = _kernel_stub  # type: ignore[method-assign]
    placeholder.__doc__ = "placeholder registered by skyrl_megatron.hosts.fixes: the compiled extension is absent"
    sys.modules["flash_attn_2_cuda"] = placeholder


def give_router_args_a_pd_flag() -> None:
    """skyrl 0.4.0's router start reads ``RouterArgs.pd_disaggregation``, which vllm-router 0.1.17 (the newest
    release) spells ``vllm_pd_disaggregation`` only: every run with vLLM servers would stop at the router's start
    with an AttributeError. The missing name reads False (skyrl sets the other one for prefill-decode splits)."""
    if importlib.util.find_spec("vllm_router") is None:
        return
    from vllm_router.router_args import RouterArgs

    if not hasattr(RouterArgs, "pd_disaggregation"):
        RouterArgs.pd_disaggregation = False
