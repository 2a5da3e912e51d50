"""Checkpoints written in the background (`megatron_config.async_save`): training goes on while the files are written.

A save has three parts, as in Megatron-Core's own asynchronous path (whose pieces this uses:
`dist_checkpointing.save(async_sharded_save=True)` plans the save and returns the write and its
finalisation as separate steps):

1. `save` (collective, in the training step): the sharded state, as for a synchronous save; then,
   before the write is planned, every accelerator storage the state's tensors lie in is queued for a
   copy into pinned host memory, whole and once (buffers kept for the next save; no wait on the
   device), so the device copies while the host plans. The plan is Megatron's, from one strategy kept
   while the state's structure stays (`_structure`): once a save's plan came out as the previous
   one's, later saves reuse it (`dist_io.save_strategy(repeated=True)`). Megatron's kept plan assumes
   the structure it was made for, so a state of another structure (saved without its optimizer, say)
   gets a fresh strategy, and Megatron's check that every shard is written once runs with it. Every
   tensor of the plan is then handed to the writer as its own bytes within its storage's copy (the
   writer serialises a tensor's whole storage); what lies outside those copies is copied on its own
   (host tensors that belong to the model or optimizer by a plain copy; tensors made for the save,
   such as pieces of the distributed optimizer's state, as they are). Where the caller names the tensors that own the
   state's storages (`storage_owners`: a colocated trainer's offloader), their copies stay valid until
   the next save (`storage_copies`), and the offload that follows the save parks the storages in them
   instead of copying again (`workers/offload.py`). Megatron's own references to the device tensors
   are replaced by the host copies, so nothing keeps device memory of the save alive while it is
   written. The write then starts in a thread of this process, and `save` returns.
2. the write: each rank's shard files, with fsync, from the copies (Megatron's file writer).
3. `finalize` (collective; before the next save and when training ends): waits for the write, then
   the steps a synchronous save ends with: the shard index, the metadata file, the check of the index
   against the files, and the rename into place. Only then is the checkpoint at its final path.

So a checkpoint saved in the background is the same files as a synchronous save of the same state,
and loads like one. Until `finalize` it exists only as the hidden `.<name>.partial` directory: a
crash (or a kill) during the write leaves the previous checkpoint at the final path, and the next
save discards the partial one. The write runs in a thread, not a helper process, so a killed rank
leaves nothing running behind it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skyrl_megatron.checkpoint.errors import CheckpointError
from skyrl_megatron.checkpoint.integrity import CheckpointMetadata
from skyrl_megatron.checkpoint.megatron_state import on_any_rank
from skyrl_megatron.checkpoint.training import (
    SaveTarget,
    begin_save,
    captured_state,
    check_room,
    finish_save,
    write_shards,
)
from skyrl_megatron.dist_io import save_strategy, writer_errors
from skyrl_megatron.optim import torch_optimizers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveTimings:
    """Where one save call's time went on this rank, in seconds (the trainer logs them per save step)."""

    finish_previous_s: float = 0.0  # finishing the background save before it: waiting for its write, publishing it;
    # in this call, or in a `finalize` since the last save that found the write still running (a trainer finishes
    # the save in flight before it saves); zero when it was published once written
    previous_write_s: float = 0.0  # how long that background write ran (against the steps between saves)
    capture_s: float = 0.0  # background save: the state described and copied to host memory, the write started
    write_s: float = 0.0  # synchronous save: the whole save
    staged_gib: float = 0.0  # background save: what was copied to host memory


class AsyncCheckpointSaver:
    """One rank's background saves: at most one in flight; `finalize` publishes it."""

    def __init__(self) -> None:
        self._pending: _PendingSave | None = None
        self._pinned = _PinnedBuffers()
        # host copies of whole storages made by the last save, by device storage; valid until the next save starts
        self._copies: dict[int, _StorageCopy] = {}
        self._strategy = None  # Megatron's save strategy, kept while the state's structure stays (it reuses its plan)
        self._validated: tuple | None = None  # that structure, which Megatron validated at the strategy's first save
        self.last_timings = SaveTimings()
        self._finished = SaveTimings()  # the last finalize of a save in flight: until the next save reports it

    @property
    def storage_copies(self) -> dict[int, torch.Tensor]:
        """The last save's host copies of the storages of its `storage_owners`, by device storage."""
        return {key: copy.host for key, copy in self._copies.items() if copy.lendable}

    def write_done(self) -> bool:
        """Whether this rank's files of the save in flight are written (True when none is in flight)."""
        return self._pending is None or not self._pending.thread.is_alive()

    def save(
        self,
        ckpt_dir: str | os.PathLike,
        chunks: Sequence[torch.nn.Module],
        optimizer=None,
        scheduler=None,
        *,
        step: int,
        extra: dict[str, Any] | None = None,
        tokenizer=None,
        storage_owners: Sequence[torch.Tensor] = (),
    ) -> Path:
        """Start saving to `ckpt_dir` (collective); the arguments and the checks are `save_checkpoint`'s.
        The save in flight before, if any, is finalized first. `storage_owners`: tensors each standing for
        a whole storage of the state (contiguous), whose copies are kept in `storage_copies`. Returns the
        final path, which exists once `finalize` has returned."""
        self.finalize()
        started = time.perf_counter()
        target = begin_save(ckpt_dir, extra, tokenizer)
        with captured_state(chunks, optimizer, scheduler, step, extra) as (metadata, sharded):
            # inside: compact masters exist here only
            structure = _structure(sharded)
            # Megatron's kept plan assumes the structure it was made for: another one is planned and validated by
            # a fresh strategy (on every rank, or on none)
            if on_any_rank(structure != self._validated):
                self._strategy, self._validated = save_strategy(repeated=True), None
            validate = self._validated is None
            # the last collective that waits for the device once the plan is reused: ahead of the copies
            check_room(sharded, target)
            owners = {_storage_of(t): t.detach() for t in storage_owners if t.is_contiguous()}
            copied = self._copy_ahead(sharded, owners)  # the device copies while the host plans the write
            request = write_shards(sharded, target, in_background=True, strategy=self._strategy, validate=validate)
            self._validated = structure
            write_args, staged = self._stage(request, chunks, optimizer, owners)
        pending = _PendingSave(target, metadata, request)
        pending.thread = threading.Thread(
            target=pending.write, args=(write_args,), name=f"checkpoint-write-{target.final.name}", daemon=True
        )
        pending.thread.start()
        self._pending = pending
        copied += staged
        self.last_timings = dataclasses.replace(
            self._finished, capture_s=time.perf_counter() - started, staged_gib=copied / 2**30
        )
        self._finished = SaveTimings()
        logger.info("checkpoint %s: state captured in %.2f s (%.1f MiB copied to host memory), written in the "
                    "background", target.final, self.last_timings.capture_s, copied / 2**20)
        return target.final

    def finalize(self) -> Path | None:
        """Wait for the save in flight, finish it and publish it (collective); its final path, or None
        when none was in flight. A failed write raises CheckpointError on every rank and publishes
        nothing."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        waits = pending.thread.is_alive()  # a save whose write is done costs its finisher only the publishing
        started = time.perf_counter()
        try:
            return self._finish(pending)
        finally:
            self._finished = SaveTimings(finish_previous_s=time.perf_counter() - started if waits else 0.0,
                                         previous_write_s=pending.write_s)

    def _finish(self, pending: "_PendingSave") -> Path:
        pending.thread.join()
        self._pinned.release()
        self._copies = {}
        # every rank's files are written; Megatron's finalisation gathers the write results, writes the
        # shard index and fails on every rank when one rank's write failed
        from torch.distributed.checkpoint.api import CheckpointException

        dist.barrier()
        try:
            for finalize_fn in pending.request.finalize_fns:
                finalize_fn()
        # torch.distributed.checkpoint reports write failures as a BaseException subclass
        except (Exception, CheckpointException) as exc:
            failed = getattr(exc, "failures", None)  # torch's {rank: error}; its text is a traceback per rank
            cause = pending.error or (f"the write failed on rank(s) {sorted(failed)}" if failed
                                      else str(exc).splitlines()[0])
            raise CheckpointError(f"background save of {pending.target.final} failed: {cause}; "
                                  "the previous checkpoint stays in place") from None
        return finish_save(pending.target, pending.metadata)

    def _copy_ahead(self, sharded: dict, owners: dict[int, torch.Tensor]) -> int:
        """Queue the host copy of every accelerator storage the state's tensors lie in, whole, once: an owner's
        as that tensor stands (lent), any other storage over all its bytes. Returns the bytes. (Host storages, in
        the CPU runtime, have nothing to overlap a copy with: `_stage` copies what the plan needs of them.)"""
        self._copies = {}
        copied = 0
        for tensor in _state_tensors(sharded):
            key = _storage_of(tensor)
            if not _copied_ahead(tensor) or key == 0 or key in self._copies:
                continue
            owner = owners.get(key)
            if owner is not None and _lies_in(tensor, owner):
                copied += self._copy_whole(key, owner, lendable=True)
            elif owner is None:
                copied += self._copy_whole(key, _whole_storage(tensor), lendable=False)
        return copied

    def _copy_whole(self, key: int, owner: torch.Tensor, *, lendable: bool) -> int:
        host = self._pinned.take(owner)
        host.copy_(owner, non_blocking=host.is_pinned())
        # where the copy lies in the storage, not the device tensor: a save must not keep device memory alive
        self._copies[key] = _StorageCopy(host, _byte_offset(owner), owner.device.type != "cpu", lendable)
        return owner.nbytes

    def _stage(self, request, chunks, optimizer, owners: dict[int, torch.Tensor]) -> tuple[list, int]:
        """The write's arguments with every tensor the training could change replaced by a host copy, and the
        bytes copied here (beside `_copy_ahead`'s)."""
        if request.async_fn is None:  # nothing to write on this rank
            return [], 0
        args = list(request.async_fn_args)
        # the model's and optimizer's host storages, found once a host tensor of the plan asks (the CPU runtime)
        live = functools.cache(lambda: _live_storages(chunks, optimizer))
        staged, copied, device_copies = [], 0, False
        for path, name, (bytes_data, tensor_data) in args[1]:
            tensors = []
            for item, tensor in tensor_data:
                tensor = tensor.detach()
                host, whole_bytes = self._view_in_storage_copy(tensor, owners.get(_storage_of(tensor)))
                if host is not None:
                    copied += whole_bytes
                elif tensor.device.type != "cpu":
                    host = self._pinned.take(tensor)
                    host.copy_(tensor, non_blocking=True)
                    copied += tensor.nbytes
                    device_copies = True
                elif _storage_of(tensor) in live():
                    host = tensor.clone()
                    copied += tensor.nbytes
                else:
                    tensors.append((item, tensor))  # made for this save: nothing else holds it
                    continue
                tensors.append((item, host))
            staged.append((path, name, (bytes_data, tensors)))
        # in place: Megatron's writer and preload step hold this list too; with the host copies in it they
        # keep no device tensor of the save alive while it is written
        args[1][:] = staged
        # device copies are queued on the current stream; the writer waits for them, not the training
        ready = None
        if device_copies or any(copy.from_device for copy in self._copies.values()):
            ready = torch.cuda.Event()
            ready.record()
        return [request.async_fn, args, request.async_fn_kwargs, ready], copied

    def _view_in_storage_copy(self, tensor: torch.Tensor, owner: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
        """`tensor`'s bytes in the host copy of its storage (`_copy_ahead`'s, or its owner's copied whole at its
        first tensor here), as a tensor whose storage is exactly those bytes, and the bytes that copy took here (0
        when it was made before); (None, 0) without a copy or an owner, for a non-contiguous tensor, or outside
        the copy's bytes. (The file writer serialises a tensor's whole storage: a plain view of the copy would
        write all of it per tensor.)"""
        key, copied = _storage_of(tensor), 0
        whole = self._copies.get(key)
        if whole is None:
            if owner is None or not _lies_in(tensor, owner):
                return None, 0
            copied = self._copy_whole(key, owner, lendable=True)
            whole = self._copies[key]
        host = whole.bytes_of(tensor)
        return (host, copied) if host is not None else (None, 0)


@dataclass(frozen=True)
class _StorageCopy:
    """A host copy of a storage's bytes from `offset` on (an owner's, or all of them)."""

    host: torch.Tensor
    offset: int  # bytes into the storage
    from_device: bool
    lendable: bool  # the caller's owner: lent to the offload that follows the save

    def bytes_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` (of the copied storage) as a tensor over its own bytes of the copy; None where it is not
        contiguous or not within the copied bytes."""
        start = _byte_offset(tensor) - self.offset
        if tensor.numel() == 0 or not tensor.is_contiguous() or start < 0 or start + tensor.nbytes > self.host.nbytes:
            return None
        # the numpy array keeps the copy alive for as long as the returned tensor lives
        data = self.host.reshape(-1).view(torch.uint8).numpy()
        own_bytes = torch.frombuffer(data, dtype=torch.uint8, count=tensor.nbytes, offset=start)
        return own_bytes.view(tensor.dtype).view(tensor.shape)


def _copied_ahead(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage is copied before the write is planned: on an accelerator, where the copy runs
    beside the host's planning (a copy of host memory is host work)."""
    return tensor.device.type != "cpu"


def _lies_in(tensor: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous, not empty, and within `owner`'s bytes of their shared storage."""
    if tensor.numel() == 0 or not tensor.is_contiguous() or _storage_of(tensor) != _storage_of(owner):
        return False
    start = _byte_offset(tensor) - _byte_offset(owner)
    return 0 <= start and start + tensor.nbytes <= owner.nbytes


def _byte_offset(tensor: torch.Tensor) -> int:
    return tensor.storage_offset() * tensor.element_size()


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A byte tensor over all of `tensor`'s storage."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _state_tensors(sharded: dict) -> list[torch.Tensor]:
    """The tensors the sharded state's shards hold (Megatron's ShardedTensors and their factories)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return [value.data.detach() for value in nested_values(sharded)
            if isinstance(value, ShardedTensor | ShardedTensorFactory) and isinstance(value.data, torch.Tensor)]


def _structure(sharded: dict) -> tuple:
    """What a save's plan and Megatron's validation of it depend on in a sharded state: each shard's
    key, shape and type, where it lies in its global tensor or object, and which replica it is; not the
    values. Equal for the saves of one model and optimizer under one layout."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def walk(node, path):
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                yield from walk(node[key], (*path, key))
        elif isinstance(node, list | tuple):
            for index, value in enumerate(node):
                yield from walk(value, (*path, index))
        elif isinstance(node, ShardedBase):
            data = getattr(node, "data", None)
            held = (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None
            yield (path, type(node).__name__, node.key, held, *(repr(getattr(node, name, None)) for name in (
                "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
                "flattened_range")))
        else:
            yield path, type(node).__name__

    return tuple(walk(sharded, ()))


@dataclass
class _PendingSave:
    target: SaveTarget
    metadata: CheckpointMetadata  # its files filled in when published
    request: Any  # Megatron's AsyncRequest: the write (async_fn) and its finalisation
    thread: threading.Thread | None = None
    error: str | None = None
    write_s: float = 0.0

    def write(self, write_args: list) -> None:
        if not write_args:
            return
        write_fn, args, kwargs, ready = write_args
        started = time.perf_counter()
        with writer_errors() as logged:
            try:
                if ready is not None:
                    ready.synchronize()
                write_fn(*args, **kwargs)  # reports most failures through the writer's results, not by raising
            except Exception as exc:  # noqa: BLE001 - finalize fails on every rank and names it
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.write_s = time.perf_counter() - started
        if logged:
            self.error = "; ".join(logged)
        if self.error:
            logger.error("checkpoint %s: background write failed: %s", self.target.final, self.error)


class _PinnedBuffers:
    """Pinned host buffers for device tensors, kept from one save to the next (the same model saves
    the same shapes; pinning host memory costs far more than copying into it)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self._used: list[tuple[tuple[torch.dtype, int, bool], torch.Tensor]] = []

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped as `like`, pinned when `like` is on an accelerator."""
        pinned = like.device.type != "cpu"
        key = (like.dtype, like.numel(), pinned)
        free = self._free.get(key)
        buffer = free.pop() if free else torch.empty(like.numel(), dtype=like.dtype, device="cpu", pin_memory=pinned)
        self._used.append((key, buffer))
        return buffer.view(like.shape)

    def release(self) -> None:
        for key, buffer in self._used:
            self._free.setdefault(key, []).append(buffer)
        self._used.clear()


def _storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _live_storages(chunks, optimizer) -> set[int]:
    """The host storages that the model and the optimizer keep and change (parameters, buffers,
    gradients, master weights, optimizer state): a tensor of the save that shares one must be copied
    before training goes on."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        # nn.Module's own methods: Megatron's DDP wrapper has a `buffers` attribute of its own
        params = list(torch.nn.Module.parameters(chunk))
        tensors += params + list(torch.nn.Module.buffers(chunk))
        tensors += [grad for param in params if (grad := getattr(param, "main_grad", None)) is not None]
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            tensors += list(group["params"])
        for state in torch_optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return {_storage_of(t) for t in tensors if t.device.type == "cpu" and _storage_of(t) != 0}
