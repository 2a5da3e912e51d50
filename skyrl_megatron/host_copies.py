"""Host tensors onto the device without waiting for it.

A copy from pageable host memory to a GPU first waits for every kernel queued on the stream (CUDA stages it
through its own pinned buffer), so a micro-batch prepared while the device computes the one before would stall
the host until the device is idle, and the device would then wait for the host. From pinned memory the copy is
queued like a kernel. The pinned source comes from PyTorch's caching host allocator, which keeps the block until
the copy that reads it has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`: from host memory to a GPU pinned and non-blocking, any other move as `Tensor.to`."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    # contiguous first: `.to` would make a non-contiguous source contiguous in pageable memory, and wait
    source = tensor.contiguous()
    source = source if source.is_pinned() else source.pin_memory()
    return source.to(device, non_blocking=True)
