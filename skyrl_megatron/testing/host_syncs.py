"""Finding device-to-host synchronisations where there is no device: the calls that would wait on a GPU.

`torch.cuda.set_sync_debug_mode("error")` names every synchronising CUDA call, but only on a GPU.
On CPU, `HostSyncProbe` records, each with the stack that made it,
- reads of a tensor's values on the host (`.tolist()`, `.item()`, `.numpy()`, `bool()`, `int()`, ...),
- operators whose output size depends on the values (`nonzero`, `masked_select`, `unique`, ...),
- explicit waits (`torch.cuda.synchronize`, `Event.synchronize`, `Stream.synchronize`; the CPU
  runtime's stand-ins included),
so a test can require a code path to make none. Copies between devices cannot be seen on CPU (every
tensor is a host tensor there); the wait that makes such a copy's values usable is what counts.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that hand the host a tensor's values (a sync when the tensor is on a GPU)
_VALUE_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
# operators whose output size depends on the values (a sync to size the output on a GPU)
_VALUE_SIZED = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "_local_scalar_dense"}


@dataclass(frozen=True)
class HostSync:
    what: str
    stack: str  # the innermost frames outside torch and this module, most recent last


def _stack() -> str:
    frames = [f for f in traceback.extract_stack() if not _plumbing(f.filename)]
    return "".join(traceback.format_list(frames[-6:]))


def _plumbing(filename: str) -> bool:
    """torch's own frames, this probe's, and the CPU runtime's redirection of CUDA calls."""
    return "/torch/" in filename or filename == __file__ or filename.endswith("skyrl_megatron/runtime.py")


class _Wrapped:
    """Records calls of some methods (Tensor value reads, CUDA waits), wrapping them while active.

    Wrapped rather than seen through a TorchFunctionMode: Python modes are not active inside custom
    autograd `backward`s, and the backward pass is half of what is probed.
    """

    def __init__(self, found: list):
        self.found = found
        self._saved: list[tuple[object, str, object]] = []

    def _targets(self):
        for name in _VALUE_READS:
            yield torch.Tensor, name, f"Tensor.{name}"
        yield torch.cuda, "synchronize", "torch.cuda.synchronize"
        for cls in (torch.cuda.Event, torch.cuda.Stream):  # the CPU runtime's stand-ins where active
            yield cls, "synchronize", f"{cls.__name__}.synchronize"

    def __enter__(self):
        for owner, name, label in self._targets():
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._recording(label, original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _recording(self, label: str, original):
        found = self.found

        def method(*args, **kwargs):
            found.append(HostSync(label, _stack()))
            return original(*args, **kwargs)

        return method


class _Operators(TorchDispatchMode):
    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in _VALUE_SIZED:
            self.found.append(HostSync(str(func), _stack()))
        return func(*args, **(kwargs or {}))


class HostSyncProbe:
    """Context manager recording host syncs-to-be in `found` (forward and backward run inside it)."""

    def __init__(self):
        self.found: list[HostSync] = []
        self._parts = (_Wrapped(self.found), _Operators(self.found))

    def __enter__(self) -> "HostSyncProbe":
        for part in self._parts:
            part.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for part in reversed(self._parts):
            part.__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"{s.what} at\n{s.stack}" for s in self.found)
