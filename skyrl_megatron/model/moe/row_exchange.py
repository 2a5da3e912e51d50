"""Moving rows between the ranks of a group with the split sizes on the device: the all-to-all under
the device-side MoE dispatch (`model/moe/device_all_to_all.py`).

One call: each rank sends its first `sum(send_splits)` rows, `send_splits[r]` of them (in rank
order) to rank r, and receives into an output of a fixed `out_rows` (the caller's worst case) whose
leading rows are the received ones, grouped by source rank; the rows past them are padding nobody
may read. The split sizes are a device tensor: no rank reads them on the host.

Two transports, one interface (`exchange(send, send_splits, out_rows, take=None) -> out`; with `take`
the rows sent are `send[take]`, a gather the NVSHMEM transport writes straight into its send buffer):

- `NvshmemExchange`: torch's 1-D NVSHMEM all-to-all (`torch.ops.symm_mem.all_to_all_vdev`, torch >=
  2.10, CUDA). Its buffers are symmetric memory, allocated collectively, so they are kept and
  reused: one set per direction and row width (rows moved as bf16 words), grown, never shrunk. The op starts
  with a barrier (the split sizes are exchanged and waited for) but pulls the rows from the peers'
  send buffers and does not wait for the peers after: a rank refilling the send buffer that the
  previous exchange used could overwrite rows a slower peer is still reading. Any other exchange in
  between orders this (its entry barrier is reached by every peer only after its previous one), so
  only two back-to-back exchanges on the same buffers need a barrier of their own; it is a
  one-element all-reduce, queued on the stream (no host wait).
- `EmulatedExchange`: the stand-in for NVSHMEM where it cannot run (gloo, the CPU runtime): the
  same contract on plain collectives, with the split sizes read on the host. Its results are the
  NVSHMEM op's bit for bit (both copy rows), which is what the CPU tests rely on.

`row_exchange_for(group)` picks one per process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# all_to_all_vdev splits each peer's bytes evenly over its thread blocks (up to 32): every row must
# be a multiple of 32 bytes. Narrower rows (a token's routing probability) are padded inside.
_ROW_BYTES_MULTIPLE = 32
_WORD = torch.bfloat16  # what the NVSHMEM op moves: every dtype's rows as 2-byte words
# symmetric buffers grow in steps of this many rows, so that micro-batches of nearby sizes share them
_ROW_STEP = 1024


class EmulatedExchange:
    """The exchange's contract on `all_to_all_single` with host split sizes (the NVSHMEM stand-in)."""

    def __init__(self, group):
        self.group = group

    def exchange(self, send: Tensor, send_splits: Tensor, out_rows: int, take: Tensor | None = None) -> Tensor:
        if take is not None:
            send = send.index_select(0, take)
        received = torch.empty_like(send_splits)
        dist.all_to_all_single(received, send_splits.contiguous(), group=self.group)
        send_sizes, receive_sizes = send_splits.tolist(), received.tolist()  # the host read NVSHMEM avoids
        if sum(receive_sizes) > out_rows:
            raise RuntimeError(f"{sum(receive_sizes)} rows arrive for an output of {out_rows}: the worst case is too small")
        out = send.new_empty(out_rows, *send.shape[1:])
        dist.all_to_all_single(out[: sum(receive_sizes)], send[: sum(send_sizes)].contiguous(), receive_sizes, send_sizes,
                               group=self.group)
        return out


class _SymmetricBuffers:
    """The NVSHMEM op's four symmetric tensors for one shape, rendezvoused on the group."""

    def __init__(self, send_rows: int, out_rows: int, width: int, dtype, device, group_name: str, world: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.send_rows, self.out_rows = send_rows, out_rows
        self.input = symm_mem.empty(send_rows, width, dtype=dtype, device=device)
        self.out = symm_mem.empty(out_rows, width, dtype=dtype, device=device)
        self.in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        self.out_splits_offsets = symm_mem.empty(2, world, dtype=torch.int64, device=device)
        for buffer in (self.input, self.out, self.in_splits, self.out_splits_offsets):
            symm_mem.rendezvous(buffer, group_name)


def padded_width(width: int, element_size: int) -> int:
    """Columns per row so that a row is a multiple of 32 bytes."""
    row_bytes = -(-width * element_size // _ROW_BYTES_MULTIPLE) * _ROW_BYTES_MULTIPLE
    return row_bytes // element_size


def _rows_step(rows: int) -> int:
    return -(-rows // _ROW_STEP) * _ROW_STEP


class NvshmemExchange:
    """The exchange on torch's 1-D NVSHMEM all-to-all; split sizes stay on the device.

    Every rank of the group must call `exchange` with the same shapes in the same order (the buffers
    are allocated collectively); the dispatcher's static, dropless sizes give that where every rank
    holds as many tokens.
    """

    def __init__(self, group):
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        self.group = group
        self.group_name = group.group_name
        self.world = group.size()
        self._buffers: dict[tuple, _SymmetricBuffers] = {}
        self._last: _SymmetricBuffers | None = None

    def _buffers_for(self, send_rows: int, out_rows: int, width: int, device) -> _SymmetricBuffers:
        # keyed by direction (send rows below or above out rows) and width in words; rows grow
        key = (send_rows <= out_rows, width, device)
        buffers = self._buffers.get(key)
        if buffers is None or buffers.send_rows < send_rows or buffers.out_rows < out_rows:
            send_cap, out_cap = _rows_step(send_rows), _rows_step(out_rows)
            if buffers is not None:
                send_cap, out_cap = max(send_cap, buffers.send_rows), max(out_cap, buffers.out_rows)
                # a peer may still be reading the old buffers: wait for every rank's device before
                # freeing them (a host sync, only when a larger micro-batch first comes)
                self._wait_for_peers(device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if self._last is buffers:
                    self._last = None
            del buffers
            self._buffers.pop(key, None)
            buffers = self._new_buffers(send_cap, out_cap, width, device)
            self._buffers[key] = buffers
        return buffers

    def _wait_for_peers(self, device) -> None:
        """A barrier queued on the stream (a one-element all-reduce): no host wait."""
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)

    def _new_buffers(self, send_rows: int, out_rows: int, width: int, device) -> _SymmetricBuffers:
        return _SymmetricBuffers(send_rows, out_rows, width, _WORD, device, self.group_name, self.world)

    def _run_op(self, buffers: _SymmetricBuffers) -> None:
        torch.ops.symm_mem.all_to_all_vdev(buffers.input, buffers.out, buffers.in_splits, buffers.out_splits_offsets,
                                           self.group_name)

    def exchange(self, send: Tensor, send_splits: Tensor, out_rows: int, take: Tensor | None = None) -> Tensor:
        width = send[0].numel()
        rows = send.shape[0] if take is None else take.numel()
        # rows travel as bf16 words whatever their dtype (the op copies bytes; bf16 is the dtype it
        # was validated with on 2 H200s, docs/benchmarks.md "MoE checks"), padded to the op's 32-byte rows
        words = send.reshape(send.shape[0], width).contiguous().view(_WORD)
        word_width = words.shape[1]
        padded = padded_width(word_width, words.element_size())
        buffers = self._buffers_for(rows, out_rows, padded, words.device)
        if buffers is self._last:
            self._wait_for_peers(send.device)  # every peer must be done pulling from these buffers
        if take is not None and padded == word_width:
            torch.index_select(words, 0, take, out=buffers.input[:rows])  # the gather writes the send buffer
        else:
            buffers.input[:rows, :word_width].copy_(words if take is None else words.index_select(0, take))
        buffers.in_splits.copy_(send_splits)
        self._run_op(buffers)
        self._last = buffers
        landed = buffers.out[:out_rows, :word_width]
        # unpadded, a view of the symmetric output (valid until the next exchange on these buffers,
        # the caller's gather reads it first); padded, a copy
        landed = landed if padded == word_width else landed.contiguous()
        return landed.view(send.dtype).view(out_rows, *send.shape[1:])


_transports: dict[str, object] = {}


def exchange_unavailable(group) -> str | None:
    """Why this group has no device-side exchange, or None: NCCL groups need torch's NVSHMEM (the
    emulation would work there, but with the host reads the exchange exists to avoid)."""
    if _on_nccl(group) and not _nvshmem_available():
        return "torch here has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available() is false)"
    return None


def row_exchange_for(group):
    """The exchange for this group: NVSHMEM on NCCL groups, the emulation on others (gloo, CPU)."""
    name = group.group_name
    if name not in _transports:
        why = exchange_unavailable(group)
        if why is not None:
            raise RuntimeError(why)
        _transports[name] = NvshmemExchange(group) if _on_nccl(group) else EmulatedExchange(group)
    return _transports[name]


def _on_nccl(group) -> bool:
    """Whether the group moves CUDA tensors through NCCL ("nccl", or "cpu:gloo,cuda:nccl")."""
    return "nccl" in str(dist.get_backend(group))


def _nvshmem_available() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return bool(symm_mem.is_nvshmem_available())
    except (ImportError, AttributeError, RuntimeError):
        return False
