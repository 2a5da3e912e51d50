"""How Megatron writes sharded (distributed) checkpoints here: the lowest layer of our checkpoint I/O.

Both the conversion cache (`model/cache.py`) and the training checkpoints (`checkpoint/`) write
Megatron distributed checkpoints; both take the write strategy and the writer workaround from this
module, which imports nothing of ours.
"""

from __future__ import annotations

import contextlib
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


def save_strategy():
    """Megatron's default save strategy; where ranks replicate shards, the save is spread over the
    replicas (each writes a share) instead of falling to the first replica."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    replicas = replica_group()
    return strategy if replicas is None else FullyParallelSaveStrategyWrapper(strategy, replicas)


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
