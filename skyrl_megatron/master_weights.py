"""Compact fp32 master weights: between optimizer steps, a master is its bf16 model weight plus 16 bits.

Megatron's distributed optimizer keeps, per bf16 parameter, an fp32 master shard (4 bytes) that only
its optimizer step reads and writes; after the step it copies the master into the bf16 model weight,
rounded to nearest even. The model weight therefore already holds the master's upper 16 bits, or
that value plus one (rounded up), and the master is exactly

    bits(master) = bits(model) * 2**16 + remainder,   remainder in [-2**15, 2**15]

(int32 bit patterns; sign-magnitude floats need no special case: a negative float's pattern and its
rounded pattern are both in the negative int32 range, and the rounding moves the magnitude by at
most half of the lower 16 bits' range, also across an exponent boundary and into inf). Between
steps we keep `remainder` as int16 (2 bytes) and free the master: 2 of the 4 bytes a parameter.
The one value int16 cannot hold is +2**15, a tie rounded down to an even model weight (about one
element in 2**17); such elements are stored as -2**15 and listed by index, to be corrected.

The work goes by runs, not tensors (an MoE model has thousands of parameter tensors; a kernel call
costs ~0.1 ms of host time): the model shards are views of Megatron DDP's contiguous parameter
buffer, so masters whose shards lie back to back there (Megatron's 64-element padding between them
allowed) form a run, of at most `_GROUP_ELEMENTS` elements. A rebuild gives each run one fp32 buffer
over its span and makes every master of it a view of that buffer; the next release splits the whole
run with one kernel call (one remainder and one list of tie indices per run, indices into the run),
and the next rebuild joins it with one. The first release after `attach` meets the optimizer's own,
separately allocated masters and gathers each run into its buffer first.

From then on the masters stay views of their run's buffer and a release frees the buffer's storage
(`resize_(0)`, as FSDP frees unsharded parameters), a rebuild gives it back and joins into it: per
tensor only the release's storage check and the dropping of its gradient reference (well under a
microsecond each). Re-pointing and freeing each master (about 6 us of host time a tensor on this
repository's CI machine, per release and per rebuild) left the device idle inside the optimizer step
at MoE widths, where thousands of masters form a few dozen runs. A master released so keeps its shape
over an empty storage: reading it before the rebuild reads freed memory and ends the process, so
everything that reads masters outside the optimizer step goes through `materialised`.

Exact by construction, and checked: an element whose remainder falls outside the range (a model
weight that is not its master rounded, e.g. NaN, or one written by something else) leaves its
whole run's masters in fp32, so a master is never rebuilt
wrong. The masters stay the same tensor objects (Adam's state and Megatron's `main_param` are keyed
by them); only their `.data` changes. Offloading parks a view's whole storage (`workers/offload.py`),
so a run kept in fp32 moves as one buffer.

Only Megatron's DistributedOptimizer over bf16 parameters with torch's Adam (no Transformer Engine)
is supported: `refusal()` says why anything else is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from skyrl_megatron import arrivals

logger = logging.getLogger(__name__)

_TIE = 1 << 15  # the remainder of a tie rounded down; int16 holds -_TIE but not +_TIE
OUT_OF_RANGE = 2  # the status of an element whose model weight is not its master rounded
# elements per eager pass: bounds the int64 temporaries (a few times 32 MiB) whatever the tensor's size
_CHUNK = 1 << 22
# elements whose remainders are computed before their checks are read at once (2 bytes each)
_GROUP_ELEMENTS = 1 << 27


def _split_chunk(bits: torch.Tensor, upper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(remainder int16 with +_TIE stored as -_TIE, status int8 per element: 0 in range, 1 a tie rounded
    down, OUT_OF_RANGE where int16 cannot hold the difference) from a master's int32 bits and its model
    weight's int16 bits. The difference is taken in int64: an unrelated pair must not wrap into range.

    The eager (CPU) path, a chunk at a time; `_chunk_stats` reduces the statuses. On GPUs one Triton pass
    (`master_weights_kernels`) computes the same remainders and reduces the statuses per block."""
    diff = bits.to(torch.int64) - upper.to(torch.int64) * (1 << 16)
    tie = diff == _TIE
    remainder = torch.where(tie, -_TIE, diff).to(torch.int16)
    outside = (diff < -_TIE) | (diff > _TIE)
    status = torch.where(outside, OUT_OF_RANGE, tie.to(torch.int8)).to(torch.int8)
    return remainder, status


def _chunk_stats(status: torch.Tensor) -> torch.Tensor:
    """int64 [worst status, ties] of one chunk's statuses (the tie count holds when the worst is in range)."""
    return torch.stack([status.amax().to(torch.int64), status.sum(dtype=torch.int64)])


def _tie_mask(bits: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Where the difference is +_TIE: the ties rounded down, stored as -_TIE."""
    return bits.to(torch.int64) - upper.to(torch.int64) * (1 << 16) == _TIE


def _join_chunk(upper: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The master's int32 bits (ties rounded down still short of 2 * _TIE); in int32's range for every
    pair the split accepted, so the narrowing is exact."""
    return (upper.to(torch.int64) * (1 << 16) + remainder).to(torch.int32)


@dataclass(frozen=True)
class _Kernels:
    split: Callable
    tie_mask: Callable
    join: Callable
    chunk: int  # elements per call
    # (remainder, stats [worst status, ties], per-block checks) in one pass, in place of `split` and `_chunk_stats`,
    # the ties' indices from those checks, in place of `tie_mask`'s search, and the join with its ties raised, in
    # place of `join` and an indexed add (each over a whole run); None: the others
    split_with_stats: Callable | None = None
    tie_indices: Callable | None = None
    join_with_ties: Callable | None = None
    # `split_with_stats` writing the model weight as the master rounded (the optimizer's copy back, in the same pass)
    round_and_split_with_stats: Callable | None = None


_EAGER = _Kernels(_split_chunk, _tie_mask, _join_chunk, _CHUNK)


@functools.cache
def _on_gpu() -> _Kernels:
    """Our Triton passes (`master_weights_kernels`): the split with its checks, the ties' indices, the join.

    They replace torch.compile-generated kernels: those took the eager chain's 0.4 s per Qwen3-4B optimizer step
    on an H200 to 62 ms (2026-11-27), but left the status reductions to torch (an int64 copy of the statuses)
    and a generated call goes through dynamo's guards each time."""
    from skyrl_megatron.master_weights_kernels import join, round_and_split_with_stats, split_with_stats, tie_indices

    return dataclasses.replace(_EAGER, split_with_stats=split_with_stats, tie_indices=tie_indices, join_with_ties=join,
                               round_and_split_with_stats=round_and_split_with_stats)


def _kernels(device: torch.device) -> _Kernels:
    return _on_gpu() if device.type == "cuda" else _EAGER


def _chunks(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[start, stop) spans of at most `chunk` elements (one empty span for an empty tensor)."""
    for start in range(0, max(numel, 1), chunk):
        yield start, min(start + chunk, numel)


def _split_on_device(master: torch.Tensor, model: torch.Tensor,
                     write_model: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(remainder int16, stats int64 [worst status, ties in chunk 0, ties in chunk 1, ...], the split's per-block
    checks where its kernels keep them for the tie search, else None) on the device, no host read: the caller
    reads the stats of many tensors at once (`_settle`). `write_model`: the model weight is first made the master
    rounded to nearest even, as the optimizer's copy back makes it (on GPUs in the split's own pass)."""
    kernels = _kernels(master.device)
    if write_model and kernels.round_and_split_with_stats is None:
        model.copy_(master)
    bits, upper = master.view(torch.int32), model.view(torch.int16)
    if master.numel() == 0:  # nothing to check
        return upper.clone(), torch.zeros(2, dtype=torch.int64, device=master.device), None
    if kernels.split_with_stats is not None:  # one chunk
        split = kernels.round_and_split_with_stats if write_model else kernels.split_with_stats
        return split(bits, upper)
    pieces, stats = [], []
    for start, stop in _chunks(master.numel(), kernels.chunk):
        remainder, status = kernels.split(bits[start:stop], upper[start:stop])
        pieces.append(remainder)
        stats.append(_chunk_stats(status))  # the statuses are freed here, chunk by chunk
    stats = torch.stack(stats)
    return _joined(tuple(pieces)), torch.cat([stats[:, 0].max().view(1), stats[:, 1]]), None


def _joined(pieces: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _tie_indices(master: torch.Tensor, model: torch.Tensor, tie_counts: list[int],
                 checks: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ties rounded down, found with their counts known (no host read); from the split's
    per-block `checks` where it kept them."""
    kernels = _kernels(master.device)
    bits, upper = master.view(torch.int32), model.view(torch.int16)
    if checks is not None:
        (count,) = tie_counts
        return kernels.tie_indices(bits, upper, checks, count)
    found = [
        torch.nonzero_static(kernels.tie_mask(bits[start:stop], upper[start:stop]), size=count).view(-1) + start
        for (start, stop), count in zip(_chunks(master.numel(), kernels.chunk), tie_counts)
        if count
    ]
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=master.device)


def _in_range(stats: list[int]) -> bool:
    return stats[0] < OUT_OF_RANGE


def _tie_counts(stats: list[int]) -> list[int]:
    return stats[1:]


def split_master(master: torch.Tensor, model: torch.Tensor,
                 write_model: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(remainder int16, indices of rounded-down ties int64) such that `join_master` gives `master`
    back bit for bit from `model`; None when `model` is not `master` rounded (nothing can be saved).
    `write_model`: make `model` the master rounded first.

    `master` fp32 and `model` bf16, both contiguous and one-dimensional, of the same length."""
    remainder, stats, checks = _split_on_device(master, model, write_model)
    stats = stats.tolist()  # a host read
    if not _in_range(stats):
        return None
    return remainder, _tie_indices(master, model, _tie_counts(stats), checks)


def join_master(model: torch.Tensor, remainder: torch.Tensor, tie_indices: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 master that `split_master` took apart: a new tensor, or written into `out` (contiguous fp32 of
    the model's length) where given."""
    kernels = _kernels(model.device)
    upper = model.view(torch.int16)
    out_bits = None if out is None else out.view(torch.int32)
    if kernels.join_with_ties is not None:
        return kernels.join_with_ties(upper, remainder, tie_indices, out=out_bits).view(torch.float32)
    bits = torch.empty(model.numel(), dtype=torch.int32, device=model.device) if out_bits is None else out_bits
    for start, stop in _chunks(model.numel(), kernels.chunk):
        bits[start:stop] = kernels.join(upper[start:stop], remainder[start:stop])
    if tie_indices.numel():
        bits[tie_indices] += 2 * _TIE
    return bits.view(torch.float32)


@dataclass
class _Master:
    master: torch.Tensor  # the optimizer's fp32 parameter (kept as an object; its .data comes and goes)
    model: torch.Tensor  # the bf16 model shard the master was last copied into (a view of the DDP buffer)
    part: int = 0  # which optimizer of a Megatron chain steps it
    offset: int = 0  # where `model` starts in its run's span (elements)

    @property
    def numel(self) -> int:
        return self.model.numel()


@dataclass
class _Piece:
    """What stands for a released run's masters: the remainder over its span and the indices of its ties."""
    remainder: torch.Tensor
    tie_indices: torch.Tensor


@dataclass
class _Run:
    """Masters whose model shards lie back to back in one storage (padding between them allowed).

    `model` is a flat bf16 view over the whole span. Present, every master's `.data` is a view of `buffer` (one
    fp32 tensor over the span); a release splits the run with one kernel call into its `piece` and frees the
    buffer's storage, the members staying its views; a rebuild gives the storage back and joins into it. The
    first release after `attach` finds Megatron's separately allocated masters and gathers them into a buffer
    first (one run's fp32 beside them at a time), as it does where a master was given storage of its own since."""
    members: list[_Master]
    model: torch.Tensor
    buffer: torch.Tensor | None = None
    piece: _Piece | None = None  # while released: what stands for the masters (`buffer`'s storage is empty)

    @property
    def span(self) -> int:
        return self.model.numel()

    @property
    def part(self) -> int:
        return self.members[0].part

    @property
    def released(self) -> bool:
        return self.piece is not None

    def whole(self) -> bool:
        """Whether the masters are present as the rebuild left them: views of `buffer` (a master given other
        storage since has the run gathered again). Only the storage is compared, the cheapest check per tensor:
        nothing of ours re-points a master into its own run's buffer elsewhere."""
        if self.buffer is None or self.released:
            return False
        storage = self.buffer.untyped_storage().data_ptr()
        return all(m.master.untyped_storage().data_ptr() == storage for m in self.members)

    def park(self, piece: _Piece) -> None:
        """Release the run: `piece` stands for its masters, the buffer's storage is freed and the members stay
        its views. Their gradients go (the step hands them over again): with a bf16 gradient buffer each is an
        fp32 copy."""
        for m in self.members:
            m.master.grad = None
        self.buffer.untyped_storage().resize_(0)
        self.piece = piece

    def unparked_buffer(self) -> torch.Tensor:
        """The buffer with its storage back, values undefined until joined into (still released until then)."""
        self.buffer.untyped_storage().resize_(4 * self.span)
        return self.buffer


# elements of padding a run may step over: Megatron starts each parameter in its DDP buffer at a
# multiple of 64 elements. The padding rides along in the run's buffers (a few bytes) and is never
# written, so its check holds like a weight's. Not wider: a wider gap could hold another data-parallel
# rank's share of a bucket, which the parameter all-gather rewrites every step, so the run would fail
# its check (still exact, but kept in fp32).
_MAX_GAP = 63


def _runs(masters: list[_Master], limit: int) -> list[_Run]:
    """Maximal runs of masters whose model shards follow one another in one storage (in storage order,
    gaps up to `_MAX_GAP`), each spanning at most `limit` elements unless one shard alone is larger:
    a run is split and checked at once, so `limit` bounds the extra memory as `_GROUP_ELEMENTS` does."""
    storages: dict[int, int] = {}  # in order of first appearance: the runs of separate tensors keep their order

    def key(m: _Master) -> tuple[int, int]:
        return storages.setdefault(m.model.untyped_storage().data_ptr(), len(storages)), m.model.storage_offset()

    grouped: list[list[_Master]] = []
    for m in sorted(masters, key=key):
        if grouped and _follows(grouped[-1], m, limit):
            grouped[-1].append(m)
        else:
            grouped.append([m])
    runs = []
    for members in grouped:
        first, last = members[0].model, members[-1].model
        for m in members:
            m.offset = m.model.storage_offset() - first.storage_offset()
        span = last.storage_offset() + last.numel() - first.storage_offset()
        model = first.view(-1) if len(members) == 1 else first.as_strided((span,), (1,), first.storage_offset())
        runs.append(_Run(members, model))
    return runs


def _follows(run: list[_Master], m: _Master, limit: int) -> bool:
    last, first = run[-1].model, run[0].model
    gap = m.model.storage_offset() - (last.storage_offset() + last.numel())
    return (
        m.model.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
        and m.part == run[-1].part
        and m.model.is_contiguous() and last.is_contiguous() and m.model.dtype == last.dtype
        and 0 <= gap <= _MAX_GAP
        and m.model.storage_offset() + m.model.numel() - first.storage_offset() <= limit
    )


@dataclass
class _Split:
    """A run split on the device (one kernel call) whose checks are not read yet."""
    run: _Run
    remainder: torch.Tensor
    stats: torch.Tensor
    checks: torch.Tensor | None  # the split's per-block checks, for its tie search (GPU), or None


def _split_run(run: _Run, write_models: bool = False) -> _Split | None:
    """The run's masters split on the device as its buffer (gathered into it first where they are not all its
    views: Megatron's masters at `attach`); None where the run is released already. `write_models`: each model
    weight rounded from its master first (the padding between shards too, to the weight it was widened from)."""
    if run.released:
        return None
    if not run.whole():
        _gather(run)
    return _Split(run, *_split_on_device(run.buffer, run.model, write_models))


class CompactMasterWeights:
    """The fp32 masters of a Megatron optimizer, released to bf16 + int16 between steps."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], parts: list[int] | None = None):
        """`pairs`: (fp32 master, bf16 model shard); `parts`: which optimizer of a chain steps each (default 0)."""
        masters = [_Master(master, model, part) for (master, model), part in zip(pairs, parts or [0] * len(pairs))]
        # empty shards (a parameter wholly on other data-parallel ranks) have nothing to release
        self._runs = _runs([m for m in masters if m.numel], _GROUP_ELEMENTS)
        self._logged = self._warned_kept = False
        self._writing = False  # inside `writing_models`: the optimizer's copy back is the release's split
        self._pending: tuple[list[_Split], HostChecks] | None = None  # a group split, its checks not read yet

    @classmethod
    def of_optimizer(cls, optimizer) -> "CompactMasterWeights":
        pairs, parts = [], []
        for index, part in enumerate(chained_parts(optimizer)):
            for models, masters in zip(part.shard_float16_groups, part.shard_fp32_from_float16_groups):
                pairs.extend(zip(masters, models))
                parts.extend([index] * len(masters))
        return cls(pairs, parts)

    @property
    def released(self) -> bool:
        return any(run.released for run in self._runs)

    @property
    def runs(self) -> int:
        """How many runs the masters form (each one kernel call per release and rebuild once gathered)."""
        return len(self._runs)

    def release(self, *, part: int | None = None, write_models: bool = False) -> int:
        """Free every master that its model weight and a remainder can rebuild; returns the bytes freed
        (net of the remainders). Call right after the step copied the masters into the model; `part`: only
        the masters that optimizer of the chain steps; `write_models`: make that copy here (`round_into_models`).

        The remainders are computed a group at a time (about `_GROUP_ELEMENTS` elements, so the extra
        memory stays small) and each group's checks are read on the host at once: one wait per group,
        not one per run or tensor and chunk (Megatron has a master per parameter: thousands at MoE
        widths). A group's checks are read once the next group's split is queued, so the device splits
        that one while the host settles this one (two groups' remainders beside the masters at most).
        Writing the models, the last group's checks are left to the next call (the step's closing release):
        the step queues what follows its copy back (the parameter gather) before the host waits for them."""
        freed = kept = 0
        with torch.profiler.record_function("skyrl_megatron.masters_release"), torch.no_grad():
            pending, self._pending = self._pending, None
            # a group left by the last call is split already: settled below, not split again
            in_flight = {id(split.run) for split in pending[0]} if pending is not None else set()
            for group in self._groups(part, write_models, in_flight):
                checks = HostChecks([split.stats for split in group])
                if pending is not None:
                    group_freed, group_kept = _settle(*pending)
                    freed, kept = freed + group_freed, kept + group_kept
                pending = group, checks
            if pending is not None and write_models:
                self._pending = pending
            elif pending is not None:
                group_freed, group_kept = _settle(*pending)
                freed, kept = freed + group_freed, kept + group_kept
        if not self._logged:
            self._logged = True
            logger.info("compact master weights: %d bytes (%.2f GiB) of fp32 masters freed between optimizer "
                        "steps (kept as bf16 weight + int16 remainder)", freed, freed / 2**30)
        if kept and not self._warned_kept:  # once: the same tensors would be named at every step
            self._warned_kept = True
            logger.warning("compact master weights: %d master elements kept in fp32 (their model weights "
                           "are not the masters rounded)", kept)
        return freed

    def _groups(self, part: int | None = None, write_models: bool = False,
                skipped: set[int] = frozenset()) -> Iterator[list[_Split]]:
        """The present masters (of `part` where given, not of the runs in `skipped`) split on the device, in groups of
        about `_GROUP_ELEMENTS` elements (each group's kernels are queued as it is taken)."""
        group, elements = [], 0
        for run in self._runs:
            if (part is not None and run.part != part) or id(run) in skipped:
                continue
            split = _split_run(run, write_models)
            if split is None:
                continue
            group.append(split)
            elements += run.span
            if elements >= _GROUP_ELEMENTS:
                yield group
                group, elements = [], 0
        if group:
            yield group

    @contextlib.contextmanager
    def writing_models(self) -> Iterator[None]:
        """Inside (the optimizer step, which reads no master after copying it into the model): the copy back is
        the release's split, `round_into_models`."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def round_into_models(self, part: int) -> bool:
        """The optimizer's copy of chain part `part`'s masters into their model weights, made by releasing them:
        on GPUs the split's own pass rounds each master into its weight (the master read once, where the copy
        and the split read it twice: 6 of 14 bytes a parameter less). Only inside `writing_models`; False
        elsewhere (a checkpoint load's copy, say), where the caller copies."""
        if not self._writing:
            return False
        self.release(part=part, write_models=True)
        return True

    def _settle_pending(self) -> None:
        """Read the checks `round_into_models` left for later and release their masters."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with torch.no_grad():
                _settle(*pending)

    def rebuild(self, *, leave: Collection[int] = ()) -> None:
        """Give every released master its exact fp32 value back (before the optimizer step), as a view
        of one fp32 buffer per run; the runs whose ids are in `leave` stay released (`compact_adam` steps them
        as they are)."""
        self._settle_pending()
        with torch.profiler.record_function("skyrl_megatron.masters_rebuild"), torch.no_grad():
            for run in self._runs:
                if not run.released or id(run) in leave:
                    continue
                remainder = run.piece.remainder
                if remainder.untyped_storage().nbytes() < remainder.nbytes:
                    raise RuntimeError("compact master weights: the optimizer state is offloaded; backload it first")
                _gather(run)

    def released_runs(self, part: int) -> list["_Run"]:
        """The released runs of chain part `part` (one remainder over the span, the masters views of a freed
        buffer): what `compact_adam` can step without rebuilding them."""
        return [run for run in self._runs if run.part == part and run.released]

    def stored_tensors(self) -> list[torch.Tensor]:
        """What stands for the released masters (remainders, tie indices): optimizer state to offload."""
        self._settle_pending()
        return [t for run in self._runs if run.released for t in (run.piece.remainder, run.piece.tie_indices)]

    @contextlib.contextmanager
    def materialised(self, *, read_only: bool = False) -> Iterator[None]:
        """The fp32 masters present inside (checkpoints, reloading the masters from the model), released
        again after when they were released before; a no-op when they are present already.

        `read_only`: the block changes neither the masters nor the model weights (a save). Their
        remainders then still hold, and the masters go back to them as they were, without the release's
        kernel pass and its wait for the device."""
        self._settle_pending()
        released = [(run, run.piece) for run in self._runs if run.released]
        if released:
            self.rebuild()
        try:
            yield
        finally:
            if released and read_only:
                for run, piece in released:
                    run.park(piece)
            elif released:
                self.release()


def _gather(run: _Run) -> None:
    """The run's masters, released or present apart, in one fp32 buffer over its span, every master a view of it."""
    if run.released:  # the storage back, one kernel call, the views unchanged
        join_master(run.model, run.piece.remainder, run.piece.tie_indices, out=run.unparked_buffer())
        run.piece = None
        return
    # present apart (Megatron's masters at `attach`, or one given storage of its own since)
    buffer = run.model.float()  # the padding between shards: its weight widened, exactly (remainder 0)
    for m in run.members:
        buffer[m.offset : m.offset + m.numel] = m.master.data.view(-1)
    for m in run.members:
        m.master.data = buffer[m.offset : m.offset + m.numel].view(m.master.shape)
    run.buffer = buffer


class HostChecks:
    """A group's stats (`_Split.stats`, concatenated) on their way to the host: on a GPU copied into pinned
    memory behind the group's kernels, so that reading them waits for this group only, not for work queued
    after it (a plain `.tolist()` waits for the whole stream)."""

    def __init__(self, stats: list[torch.Tensor]):
        joined = torch.cat(stats)
        self._ready = None
        if joined.is_cuda:
            self._host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
            self._host.copy_(joined, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = joined

    def read(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def _settle(group: list[_Split], checks: HostChecks) -> tuple[int, int]:
    """Release the group's masters whose checks hold (one host read for the whole group); returns
    (bytes freed, elements kept in fp32).

    A run whose check fails stays in fp32 as a whole: the check fails only where a model weight is not
    its master rounded (NaN, or written by something other than the optimizer step), which normal
    training never does; splitting it per tensor would mean copying the kept masters out of the shared
    buffer (a view keeps all of it alive) and a kernel call per tensor at every step, for memory alone.
    Nothing of a kept run is freed, so nothing is rebuilt wrong."""
    stats = checks.read()
    freed = kept = offset = 0
    for split in group:
        run = split.run
        mine, offset = stats[offset : offset + split.stats.numel()], offset + split.stats.numel()
        if not _in_range(mine):
            kept += sum(m.numel for m in run.members)
            continue
        piece = _Piece(split.remainder, _tie_indices(run.buffer, run.model, _tie_counts(mine), split.checks))
        freed += 4 * run.span - piece.remainder.nbytes - piece.tie_indices.nbytes
        run.park(piece)
    return freed, kept


def chained_parts(optimizer) -> list:
    """The optimizers of a Megatron chain, or the optimizer itself where it is not one."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def refusal(optimizer) -> str | None:
    """Why compact master weights cannot run on this Megatron optimizer, or None when they can."""
    from megatron.core.optimizer import DistributedOptimizer

    for part in chained_parts(optimizer):
        if not isinstance(part, DistributedOptimizer):
            return (f"it needs Megatron's distributed optimizer (ddp_config.use_distributed_optimizer: true), "
                    f"got {type(part).__name__}")
        config, ddp_config = part.config, part.ddp_config
        if not config.bf16 or config.fp16:
            return "it needs bf16 parameters (trainer.bf16: true); fp16 and fp32 parameters are not supported"
        if config.optimizer != "adam":
            return f"it needs the Adam optimizer, got optimizer_config_kwargs.optimizer={config.optimizer!r}"
        if config.use_precision_aware_optimizer:
            return "Transformer Engine's precision-aware optimizer keeps its own masters (use_precision_aware_optimizer)"
        if config.optimizer_cpu_offload:
            return "the CPU-offloaded optimizer keeps its own masters (optimizer_cpu_offload)"
        if ddp_config.use_megatron_fsdp or ddp_config.fp8_param_gather or getattr(ddp_config, "fp4_param_gather", False):
            return "Megatron-FSDP and fp8/fp4 parameter gathers are not supported"
        if not isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW):
            return f"it needs torch's Adam/AdamW inside Megatron's optimizer, got {type(part.optimizer).__name__}"
    return None


# the compact masters of each optimizer that has them (a weak map: the optimizer owns its lifetime)
_ATTACHED: "weakref.WeakKeyDictionary[object, CompactMasterWeights]" = weakref.WeakKeyDictionary()


def attach(optimizer) -> CompactMasterWeights:
    """Compact this optimizer's masters from now on (they are released at once). Check `refusal` first."""
    masters = CompactMasterWeights.of_optimizer(optimizer)
    _ATTACHED[optimizer] = masters
    masters.release()
    return masters


def compact_masters_of(optimizer) -> CompactMasterWeights | None:
    """This optimizer's compact masters (None without them), their remainders arrived where they were on their
    way back to the device (`arrivals`)."""
    if optimizer is None:
        return None
    arrivals.settle(optimizer)
    return _ATTACHED.get(optimizer)


@contextlib.contextmanager
def masters_materialised(optimizer, *, read_only: bool = False) -> Iterator[None]:
    """`CompactMasterWeights.materialised` of this optimizer; a no-op without compact masters."""
    masters = compact_masters_of(optimizer)
    if masters is None:
        yield
        return
    with masters.materialised(read_only=read_only):
        yield
