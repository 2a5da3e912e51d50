"""An out-of-memory inside a worker's step, raised as an error that names the worker and the knob.

PyTorch's own message ("CUDA out of memory. Tried to allocate 2.00 GiB ...") names neither the
worker role nor the setting that sized the allocation. The trainer-facing calls (scoring, training)
run under :func:`explains_out_of_memory`, which turns an allocator failure into
:class:`WorkerOutOfMemory`: which worker, in which phase, the memory it held, and the keys that
shrink the step (the token budget, the micro-batch size, activation recompute) with their current
values. The original tensors are released before the new error travels, so a caller that catches it
finds the memory free again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from skyrl_megatron.failures import ReportedFailure
from skyrl_megatron.workers.offload import device_memory_gib


class WorkerOutOfMemory(ReportedFailure):
    """A worker ran out of accelerator (or host) memory in a step; the message says what to turn."""


# Allocator failures that do not come through PyTorch's caching allocator arrive as RuntimeErrors (or
# torch.AcceleratorError, one of them) worded by their library: the CPU allocator, cuBLAS's workspace,
# a kernel launch's own cudaMalloc.
_OUT_OF_MEMORY_WORDINGS = ("can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's caching allocator raises ``torch.OutOfMemoryError``; other allocators a RuntimeError in their words."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(wording in str(error) for wording in _OUT_OF_MEMORY_WORDINGS)


@dataclass(frozen=True)
class StepKnobs:
    """Where the sizes of a worker's step come from, for the message (host config key -> value)."""

    role: str  # policy | ref | critic
    token_budget_key: str  # max_tokens_per_microbatch, or forward_max_tokens_per_microbatch when scoring has its own
    token_budget: int | None
    micro_batch_key: str  # trainer.micro_train_batch_size_per_gpu or trainer.micro_forward_batch_size_per_gpu
    micro_batch_size: int
    recompute_granularity: str | None

    def advice(self, phase: str) -> str:
        prefix = f"trainer.{self.role}.megatron_config"
        if self.token_budget is None:
            budget = (f"set {prefix}.{self.token_budget_key} (a token budget, e.g. 8192; micro-batches are "
                      f"split by count now) or lower {self.micro_batch_key} (now {self.micro_batch_size})")
        else:
            budget = f"lower {prefix}.{self.token_budget_key} (now {self.token_budget})"
        steps = [budget]
        if phase == "training" and self.recompute_granularity != "full":
            now = self.recompute_granularity or "off"
            steps.append(f"turn on activation recompute: {prefix}.transformer_config_kwargs."
                         f"recompute_granularity=full (now {now}), or selective with recompute_modules")
        return "; ".join(steps)


def _memory_held() -> str:
    memory = device_memory_gib()
    if not memory:
        return "host memory exhausted"
    return (f"{memory['allocated_gib']:.1f} GiB allocated, {memory['reserved_gib']:.1f} GiB reserved by this "
            f"worker, {memory['device_total_gib']:.1f} GiB on the device")


@contextlib.contextmanager
def explains_out_of_memory(worker: str, phase: str, knobs: StepKnobs):
    """Run a step; an allocator failure inside it leaves as :class:`WorkerOutOfMemory`.

    ``worker`` names the process as the user knows it (role, rank, mesh coordinates).
    """
    message = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 -- only allocator failures are rewritten
        if not is_out_of_memory(error):
            raise
        # The traceback holds the step's frames and with them its activations: drop it before
        # reporting, so the figures below and any caller see the memory as it is once the step is gone.
        error.__traceback__ = None
        first_line = str(error).splitlines()[0][:300]
        message = f"{worker} ran out of memory while {phase} ({first_line})"
        del error
    if message is None:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    raise WorkerOutOfMemory(f"{message}. After the step: {_memory_held()}. To fit: {knobs.advice(phase)}.") from None
