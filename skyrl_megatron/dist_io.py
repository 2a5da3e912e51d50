"""How Megatron writes sharded (distributed) checkpoints here: the lowest layer of our checkpoint I/O.

Both the conversion cache (`model/conversion/cache.py`) and the training checkpoints (`checkpoint/`) write
Megatron distributed checkpoints; both take the write strategy and the writer workaround from this
module, which imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import logging
import queue


@contextlib.contextmanager
def writer_results_in_process():
    """Let Megatron's synchronous checkpoint writes run without a helper process.

    Megatron 0.19.2's torch_dist writer (strategies/filesystem_async.py) writes with threads, but
    passes their results on through a multiprocessing Manager queue that it creates at a rank's
    first save and keeps for the life of the process. That Manager is a spawned Python server: it
    re-imports the caller's `__main__` (hundreds of MB resident, seconds to start), no at-fork hook
    runs in it (spawn execs a fresh interpreter), and it lives on as an orphan when the rank is
    SIGKILLed. A synchronous save puts and takes the results in this very process, so a plain
    queue carries them, and no process is started at all. The previous queue comes back afterwards:
    Megatron's asynchronous save, which writes from another process, needs the Manager.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


class _LoggedErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def writer_errors():
    """The errors Megatron's file writer logs in the block (a list, filled as they come).

    Megatron 0.19.2's writer threads catch their exception, log it, and the collecting code then asserts on
    its type: what reaches the caller is `AssertionError: <class 'OSError'>`, with the message (say, "No
    space left on device") only in the log. Callers put the logged messages into their own error.
    """
    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    handler = _LoggedErrors()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


# Each rank writes its shards through this many threads (one file each). Megatron's default is one: a
# single writer reached 1.05 GiB/s with fsync on an H200 machine's disk, four reached 1.83 GiB/s.
WRITE_THREADS = 4


def save_strategy(*, repeated: bool = False):
    """Megatron's torch_dist save strategy with `WRITE_THREADS` writers per rank; where ranks replicate
    shards, the save is spread over the replicas (each writes a share) instead of falling to the first
    replica.

    `repeated`: one strategy serves a series of saves of the same state's structure (a trainer's
    checkpoints): it keeps what it planned, and once a save's plan came out equal to the previous one,
    later saves reuse it and the global metadata instead of planning and gathering again (Megatron's
    `cached_metadata`); the replicas' share of the shards is kept too (`do_cache_distribution`)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(thread_count=WRITE_THREADS, cached_metadata=repeated)
    replicas = replica_group()
    if replicas is None:
        return strategy
    return FullyParallelSaveStrategyWrapper(strategy, replicas, do_cache_distribution=repeated)


def replica_group():
    """The data- and context-parallel group (the ranks holding copies of this rank's model-parallel
    shards), or None when it is this rank alone: the wrappers would then only add collectives.

    Spreading over this group is correct under any layout: a shard is given to one member that holds
    it, and the wrapper re-validates that every shard is written exactly once. Expert shards, which
    replicate over the expert-data-parallel group instead, are spread as far as the two groups overlap.
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return None
    return ps.get_data_parallel_group(with_context_parallel=True)


def _overlapping_pair(shards, sharded_dims: list[int]) -> tuple[int, int] | None:
    """Indices of two overlapping shards, or None: a sweep along the dimension with the most distinct
    shard offsets (our replacement for torch's `_find_nd_overlapping_shards`; see below)."""
    from bisect import bisect_right, insort

    from torch.distributed._shard.sharding_spec._internals import _check_shard_metadata_pair_overlap

    if len(shards) <= 1 or not sharded_dims:
        return None
    sweep = max(sharded_dims, key=lambda dim: len({shard.shard_offsets[dim] for shard in shards}))
    order = sorted(range(len(shards)), key=lambda i: shards[i].shard_offsets[sweep])
    open_shards: list[tuple[int, int]] = []  # (end along the sweep, index), sorted
    for index in order:
        start = shards[index].shard_offsets[sweep]
        del open_shards[: bisect_right(open_shards, (start, len(shards)))]  # ended at or before start
        for _, other in open_shards:
            if _check_shard_metadata_pair_overlap(shards[other], shards[index]):
                return other, index
        insort(open_shards, (start + shards[index].shard_sizes[sweep], index))
    return None


class _ShardsByOffset:
    """torch's `_find_shard` (the local shard of a ShardedTensor at an offset) by a dict per tensor,
    built on its first lookup: torch scans the shards for every lookup, one per shard written."""

    def __init__(self, fallback):
        self.fallback = fallback
        self._maps: dict[int, tuple[object, dict]] = {}  # id -> (the tensor, kept so ids stay unique; map)

    def __call__(self, tensor, index):
        if index.offset is None:
            return self.fallback(tensor, index)  # torch's error
        entry = self._maps.get(id(tensor))
        if entry is None:
            import torch

            shards = {torch.Size(shard.metadata.shard_offsets): shard for shard in tensor.local_shards()}
            entry = self._maps[id(tensor)] = (tensor, shards)
        shard = entry[1].get(index.offset)
        return shard if shard is not None else self.fallback(tensor, index)


@contextlib.contextmanager
def fast_shard_bookkeeping():
    """Let torch's checkpoint code handle Megatron's many-shard tensors without quadratic searches.

    Saving or loading a distributed checkpoint builds a torch ShardedTensor per Megatron tensor. MoE
    expert weights are a [layers, experts, rows, cols] grid of one shard per layer and expert (fc1's rows
    split in two: gate, up): 2,048 shards for 8 layers of 128 experts, 12,288 for Qwen3-30B-A3B's 48.
    Two of torch's steps are quadratic in that count:
    - the overlap check sweeps along the dimension where the first shard ends furthest out: the rows,
      whose two offsets leave half the shards open at once. Swept along the axis with the most distinct
      offsets (the experts), one expert's shards are open at a time; the same answer for any layout.
    - a save looks up every shard it writes by a scan over the tensor's shards; here by a dict.
    On CPU at 48 layers, one overlap check: 12.2 s -> 0.19 s (tests/test_dist_io.py).
    """
    from torch.distributed._shard.sharding_spec import _internals
    from torch.distributed.checkpoint import utils as checkpoint_utils

    previous = _internals._find_nd_overlapping_shards, checkpoint_utils._find_shard
    _internals._find_nd_overlapping_shards = _overlapping_pair
    checkpoint_utils._find_shard = _ShardsByOffset(previous[1])
    try:
        yield
    finally:
        _internals._find_nd_overlapping_shards, checkpoint_utils._find_shard = previous
