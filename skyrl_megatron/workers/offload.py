"""Move a worker's model and optimizer state off the accelerator and back (colocated generation).

When the inference engine shares the GPUs, the trainer offloads between phases. Megatron keeps a
DDP-wrapped model's parameters and gradients in a few large contiguous buffers, and every
parameter is a view into one of them; offloading therefore copies each buffer to host memory and
frees the device storage *in place* (``untyped_storage().resize_(0)``), so the views stay valid
and backloading restores the storage under the same tensors. A model without DDP (the reference
model) and the optimizer's fp32 main parameters and Adam moments are handled per tensor the same
way (per storage: a tensor that views part of a storage parks all of it). Each call reports the
bytes moved and the seconds it took.

With `overlap_optimizer` (`megatron_config.overlap_optimizer_backload`), on a GPU, the optimizer's state comes
back on a CUDA stream of its own: it is first needed at the optimizer step, after the first micro-batches'
forward and backward, which run beside its copies (a Qwen3-4B policy's Adam moments and master remainders are
about 40 GB, 0.8 s at the host link's 48 GiB/s). The optimizer's first reader waits for them
(`skyrl_megatron.arrivals`); a backload's seconds then count the model's copies and only the issuing of the
optimizer's.

The same code runs in the CPU runtime, where "device" memory is host memory: the copies and
storage frees are real, which is what the tests check.

Gradient buffers released between training steps (`compute/gradient_buffers.py`) have no storage
to move; they are skipped here and come back when training starts.

Pinned host buffers are kept from one offload to the next, one per parked storage: pinning is slow (about
2.3 GiB/s on an H200 host, 23-35 s for a Qwen3-4B policy's 52 GiB) where copying into pinned memory is not
(52 GiB in 1.0 s), and PyTorch's pinned-memory cache, which the offloads otherwise relied on, lends freed
blocks to any later request (a background checkpoint's staging took them once, 2026-11-29, and the next
offload pinned 52 GiB anew).

A background checkpoint copies most of the same storages to host memory just before a colocated trainer
offloads them (the save comes right after training; the offload before the weights go to the engine). The
save can lend those copies (`lend`): an offload that finds a lent, still current copy of a storage parks it
there and copies nothing. A lent copy is current while no optimizer step or checkpoint load has run since it
was made (`state_changes`), and it is used for one offload at most.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from skyrl_megatron import arrivals, state_changes
from skyrl_megatron.compute.gradient_buffers import ddp_buffers
from skyrl_megatron.master_weights import compact_masters_of
from skyrl_megatron.optim import torch_optimizers


@dataclass
class TransferReport:
    direction: str  # "offload" | "backload"
    bytes_moved: int = 0
    seconds: float = 0.0
    parts: list[str] = field(default_factory=list)
    bytes_lent: int = 0  # of bytes_moved: parked in copies lent by a checkpoint (nothing copied)

    def as_dict(self) -> dict:
        return {
            "direction": self.direction,
            "gib_moved": self.bytes_moved / 2**30,
            "gib_lent": self.bytes_lent / 2**30,
            "seconds": self.seconds,
            "parts": list(self.parts),
        }


def device_memory_gib() -> dict[str, float]:
    """This process's allocated and reserved accelerator memory, and the device's free and total
    memory (GiB); {} on CPU."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "device_free_gib": free / 2**30,
        "device_total_gib": total / 2**30,
    }


class TransferLog:
    """The host's offload/backload calls since the log was last drained, for per-step reporting.

    Each entry is a transfer report plus the memory figures right after it: after an offload,
    ``allocated_gib`` is what this worker still holds on the device (it must not grow over a run)
    and ``device_free_gib`` what the colocated engine can have.
    """

    def __init__(self):
        self._entries: list[dict] = []

    def add(self, report: TransferReport) -> None:
        self._entries.append({**report.as_dict(), **device_memory_gib()})

    def drain(self) -> dict[str, float]:
        entries, self._entries = self._entries, []
        summary: dict[str, float] = {"transfers": float(len(entries))}
        for direction in ("offload", "backload"):
            moved = [e for e in entries if e["direction"] == direction]
            summary[f"{direction}_gib"] = sum(e["gib_moved"] for e in moved)
            summary[f"{direction}_s"] = sum(e["seconds"] for e in moved)
        summary["offload_lent_gib"] = sum(e["gib_lent"] for e in entries if e["direction"] == "offload")
        offloads = [e for e in entries if e["direction"] == "offload" and "allocated_gib" in e]
        if offloads:
            summary["allocated_gib_after_offload"] = offloads[-1]["allocated_gib"]
            summary["device_free_gib_after_offload"] = offloads[-1]["device_free_gib"]
        return summary


class _ParkedTensor:
    """A tensor whose storage is parked in `host` (shaped as it) while its device storage is freed."""

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, holds_values: bool = False):
        self.tensor = tensor
        self.host = host
        if not holds_values:
            self.host.copy_(tensor, non_blocking=host.is_pinned())
        self.nbytes = tensor.untyped_storage().nbytes()

    def free_device(self) -> None:
        self.tensor.untyped_storage().resize_(0)

    def reserve(self) -> None:
        self.tensor.untyped_storage().resize_(self.nbytes)

    def fill(self) -> None:
        self.tensor.copy_(self.host, non_blocking=True)


def _model_tensors(chunks) -> list[torch.Tensor]:
    """The tensors that own the model's storage: DDP buffers when wrapped, else each parameter."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        for buffer in ddp_buffers(chunk):
            tensors.append(buffer.param_data)
            if buffer.grad_data is not None:
                tensors.append(buffer.grad_data)
        # Parameters DDP does not own: every one of a bare module, and under LoRA the frozen base
        # (DDP buffers hold only trainable parameters).
        in_buffers = {t.untyped_storage().data_ptr() for t in tensors if t is not None}
        tensors.extend(p.data for p in chunk.parameters() if p.data.untyped_storage().data_ptr() not in in_buffers)
    return [t for t in tensors if t is not None and t.untyped_storage().nbytes() > 0]


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The inner torch optimizer's parameters (fp32 main params) and state (Adam moments), and what
    stands for compact master weights between steps (their remainders; released masters hold nothing)."""
    seen: set[int] = set()
    masters = compact_masters_of(optimizer)
    tensors = list(masters.stored_tensors()) if masters is not None else []
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                tensors.append(param.data)
                for value in inner.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        tensors.append(value)
    unique = []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.untyped_storage().nbytes() > 0:
            seen.add(key)
            unique.append(_whole_storage(t))
    return unique


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or, where it is a view of part of its storage, a byte tensor over all of it: parking frees
    the whole storage, so all of it must be copied (compact master weights kept in fp32 are views of one
    buffer per run of parameters)."""
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and tensor.is_contiguous() and tensor.nbytes == storage.nbytes():
        return tensor
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class ModelOffloader:
    def __init__(self, chunks, overlap_optimizer: bool = False, keep_host_buffers: bool | None = None):
        self.chunks = chunks
        self.overlap_optimizer = overlap_optimizer
        self._parked: dict[str, list[_ParkedTensor]] = {}
        self._arrival_stream = None  # the optimizer state's copies back to the GPU (created at the first)
        # host buffers by the device storage they hold (None: kept where pinned, i.e. on GPUs; in the CPU
        # runtime "device" memory is host memory, and a kept copy would double it)
        self.keep_host_buffers = keep_host_buffers
        self._host_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lent: dict[int, torch.Tensor] = {}  # host copies by device storage (`lend`)
        self._lent_at = -1  # state_changes.count() when they were made

    def storage_owners(self, optimizer_obj=None) -> list[torch.Tensor]:
        """The tensors an offload parks, each standing for its whole storage: what a lent copy must copy."""
        model = _model_tensors(self.chunks)
        if optimizer_obj is None:
            return model
        in_model = {_storage_key(t) for t in model}
        return model + [t for t in _optimizer_tensors(optimizer_obj) if _storage_key(t) not in in_model]

    def lend(self, copies: dict[int, torch.Tensor]) -> None:
        """Host copies of device storages' current values (by `untyped_storage().data_ptr()`), each shaped as
        its storage's owner in `storage_owners`, whose copies have been queued on the current stream. The next
        offload of those storages parks them there instead of copying, while the state has not changed. The
        caller keeps the copies unchanged until the storages are back on the device."""
        self._lent, self._lent_at = dict(copies), state_changes.count()

    def _take_lent(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if self._lent_at != state_changes.count():
            self._lent.clear()
            return None
        host = self._lent.pop(_storage_key(tensor), None)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            return None
        return host

    def _host_buffer(self, tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        """Where `tensor` is parked: the buffer kept for its storage when it still fits, else a new one."""
        keep = pin_memory if self.keep_host_buffers is None else self.keep_host_buffers
        storage = tensor.untyped_storage()
        kept = self._host_buffers.get(storage) if keep else None
        if kept is not None and kept.shape == tensor.shape and kept.dtype == tensor.dtype and kept.is_pinned() == pin_memory:
            return kept
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin_memory)
        if keep:
            self._host_buffers[storage] = host
        return host

    def _park(self, name: str, tensors: list[torch.Tensor], pin_memory: bool, report: TransferReport) -> None:
        if name in self._parked or not tensors:
            return
        if name != "model":
            # optimizer tensors that are views of the model's storage (fp32 main params) move with
            # the model, never on their own
            model_storages = {_storage_key(t) for t in _model_tensors(self.chunks)}
            model_storages |= {_storage_key(p.tensor) for p in self._parked.get("model", [])}
            tensors = [t for t in tensors if _storage_key(t) not in model_storages]
        if self._arrival_stream is not None:
            # a kept host buffer may still be the source of the last backload's optimizer copies
            torch.cuda.current_stream().wait_stream(self._arrival_stream)
        parked = []
        for t in tensors:
            lent = self._take_lent(t)
            if lent is None:
                parked.append(_ParkedTensor(t, self._host_buffer(t, pin_memory)))
            else:
                parked.append(_ParkedTensor(t, lent, holds_values=True))
                report.bytes_lent += parked[-1].nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies (ours and a lender's) must land before the storage goes
        for p in parked:
            p.free_device()
        self._parked[name] = parked
        report.bytes_moved += sum(p.nbytes for p in parked)
        report.parts.append(name)

    def _restore(self, name: str, report: TransferReport) -> None:
        for p in self._parked.pop(name, []):
            p.reserve()
            p.fill()
            report.bytes_moved += p.nbytes
        report.parts.append(name)

    def _restore_arriving(self, optimizer_obj, report: TransferReport) -> None:
        """The optimizer's state back on the GPU through its own stream; its first reader waits (`arrivals`)."""
        parked = self._parked.pop("optimizer", [])
        current = torch.cuda.current_stream()
        for p in parked:
            p.reserve()  # allocated on the current stream, which may still be using the memory it reuses
        if self._arrival_stream is None:
            self._arrival_stream = torch.cuda.Stream()
        stream = self._arrival_stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for p in parked:
                p.fill()
        for p in parked:
            p.tensor.record_stream(stream)  # freed by a later offload only once its copy is done
        copied = stream.record_event()

        def wait(parked=parked) -> None:  # the pinned host buffers stay referenced until the device waits
            torch.cuda.current_stream().wait_event(copied)

        arrivals.expect(optimizer_obj, wait)
        report.bytes_moved += sum(p.nbytes for p in parked)
        report.parts.append("optimizer")

    def offload(self, *, model: bool, optimizer: bool, optimizer_obj=None, pin_memory: bool = True) -> TransferReport:
        report = TransferReport("offload")
        started = time.perf_counter()
        if model:
            self._park("model", _model_tensors(self.chunks), pin_memory, report)
        if optimizer:
            self._park("optimizer", _optimizer_tensors(optimizer_obj), pin_memory, report)
        report.seconds = time.perf_counter() - started
        return report

    def backload(self, *, model: bool, optimizer: bool, optimizer_obj=None) -> TransferReport:
        report = TransferReport("backload")
        started = time.perf_counter()
        self._lent.clear()  # what comes back is the parked values: a copy lent before is no longer needed
        if model and "model" in self._parked:
            self._restore("model", report)
        arriving = False
        if optimizer and "optimizer" in self._parked:
            arriving = self.overlap_optimizer and torch.cuda.is_available() and optimizer_obj is not None
            if arriving:
                self._restore_arriving(optimizer_obj, report)
            else:
                self._restore("optimizer", report)
        if torch.cuda.is_available():
            # the model's copies; the optimizer's, when arriving, complete on their own stream
            torch.cuda.current_stream().synchronize() if arriving else torch.cuda.synchronize()
        report.seconds = time.perf_counter() - started
        return report

    @property
    def offloaded(self) -> set[str]:
        return set(self._parked)
