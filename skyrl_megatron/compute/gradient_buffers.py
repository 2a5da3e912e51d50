"""Megatron DDP's gradient buffers, allocated only while the model trains.

A DDP-wrapped model keeps its gradients in a few contiguous buffers (fp32 with
`grad_reduce_in_fp32`: 4 bytes per trained parameter, 15 GiB at Qwen3-4B), and every parameter's
`main_grad` is a view into one of them. Between one step's optimizer update and the next step's
first backward nothing reads them: `ModelRunner.train_mini_batch` zeroes them before it starts.
So scoring, weight export, checkpointing and colocated generation can run without their device
storage. `release()` frees the storage in place (`untyped_storage().resize_(0)`, no copy) and
`restore()` brings it back, uninitialised, under the same tensors, so every view stays valid.
"""

from __future__ import annotations

import torch


def ddp_buffers(chunk) -> list:
    """A DDP wrapper's contiguous parameter/gradient buffers (dense and expert); none for a bare
    module (the reference model), where `buffers` is nn.Module's method."""
    return [
        buffer
        for name in ("buffers", "expert_parallel_buffers")
        if isinstance(getattr(chunk, name, None), (list, tuple))
        for buffer in getattr(chunk, name)
    ]


class GradientBuffers:
    def __init__(self, chunks: list[torch.nn.Module]):
        self.chunks = chunks
        self._released: list[tuple[torch.Tensor, int]] = []

    def _allocated(self) -> list[torch.Tensor]:
        # a buffer without storage is released here or parked by the offloader: not ours to free
        return [
            buffer.grad_data
            for chunk in self.chunks
            for buffer in ddp_buffers(chunk)
            if buffer.grad_data is not None and buffer.grad_data.untyped_storage().nbytes() > 0
        ]

    def release(self) -> int:
        """Free the gradient storage (idempotent); returns the bytes freed."""
        freed = 0
        for grad_data in self._allocated():
            nbytes = grad_data.untyped_storage().nbytes()
            grad_data.untyped_storage().resize_(0)
            self._released.append((grad_data, nbytes))
            freed += nbytes
        return freed

    def restore(self) -> None:
        """Bring the released storage back, uninitialised (idempotent)."""
        for grad_data, nbytes in self._released:
            grad_data.untyped_storage().resize_(nbytes)
        self._released = []
