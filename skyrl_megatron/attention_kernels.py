"""The segment kernels of our core attention and `megatron_config.attention_kernel`, without torch.

Which kernel a model runs is decided in one place, `model/layers/attention.select_segment_kernel`; this
module holds only what the up-front config check (`config.py`, no torch, no Megatron) needs too: the
kernels' names and whether flash-attn-4 is installed, found without importing it.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.metadata
import importlib.util

KEY = "megatron_config.attention_kernel"
AUTO = "auto"


class SegmentKernel(enum.Enum):
    """Causal attention over packed segments (`model/layers/attention.attend_segments`); values are the key's."""

    FLASH4 = "flash4"  # flash-attn-4's CuTe kernels (`flash_attn.cute`): Hopper and Blackwell, bf16/fp16
    VARLEN = "varlen"  # torch's `varlen_attn` (FlashAttention-2 kernels): CUDA, bf16/fp16
    MASKED_SDPA = "sdpa"  # one SDPA call with a block-diagonal causal mask: any device and dtype, O(T^2) memory

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    SegmentKernel.FLASH4: "flash-attn-4 CuTe (flash_attn.cute)",
    SegmentKernel.VARLEN: "torch varlen_attn (FlashAttention-2)",
    SegmentKernel.MASKED_SDPA: "masked SDPA",
}

ATTENTION_KERNELS: tuple[str, ...] = (AUTO, *(kernel.value for kernel in SegmentKernel))

# flash-attn-4's Hopper (sm90) and Blackwell (sm100) kernels: the ones of its FA3/FA4 design, and the
# ones measured against varlen_attn (docs/performance.md); its Ampere path is older and unmeasured here
FLASH4_COMPUTE_MAJORS = (9, 10)
FLASH4_INSTALL_FIX = "pip install flash-attn-4 (or skyrl-megatron[fa4]) on every worker node, or set attention_kernel=auto"


def flash4_installed() -> bool:
    """Whether flash-attn-4 is installed: its distribution, and `flash_attn.cute` where Python looks.

    The distribution is asked for because flash-attn 2.8.3 ships an early `flash_attn/cute` of its
    own, without the kernels we call. The parent package is looked up, not imported: an installed
    flash-attn 2 imports torch and its CUDA extension from its `__init__`."""
    try:
        importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    try:
        parent = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    if parent is None or parent.submodule_search_locations is None:
        return False
    return importlib.machinery.PathFinder.find_spec("flash_attn.cute", list(parent.submodule_search_locations)) is not None
