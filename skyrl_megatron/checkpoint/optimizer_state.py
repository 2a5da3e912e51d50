"""The distributed optimizer's state for a save, described without Megatron's gather.

Megatron-Core's `fully_reshardable` save (the format of our checkpoints: it reshards across TP, PP and
DP) first gathers every buffer's optimizer state on data-parallel rank 0 into fresh host tensors: per
parameter a pageable device-to-host copy, zero-filled world buffers, the gather, a concatenation and a
copy, synchronously, before the save can start (on one H200 about 20 s of a 0.6B model's save, measured
2026-11-28). It then describes each model parameter's state as sharded tensors shaped and replicated like
the parameter, keyed `optimizer.state.<key>.<model key>`.

`state_without_gather` describes the same sharded tensors from where the state already is. Each data-
parallel rank holds one contiguous range of every bucket, so a parameter's flattened state lies on one
rank (most parameters) or across a few neighbours (the parameters a range boundary cuts). The lowest rank
holding a piece of a parameter describes its state: its own piece as a view, the others' pieces sent to
it point to point (boundary parameters only). Each sharded tensor has exactly one rank, the main replica,
so the files are those of Megatron's path, bit for bit, and load through it under any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist


def distributed_optimizers(optimizer) -> list:
    """The Megatron distributed optimizers inside `optimizer` (chained or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if hasattr(optimizer, "chained_optimizers"):
        return [o for chained in optimizer.chained_optimizers for o in distributed_optimizers(chained)]
    return [optimizer] if isinstance(optimizer, DistributedOptimizer) else []


@contextlib.contextmanager
def state_without_gather(optimizer):
    """While saving: every distributed optimizer in `optimizer` describes its state by `model_space_state`
    in place of Megatron's gathering `sharded_param_state_fully_reshardable` (loading keeps Megatron's)."""
    patched = distributed_optimizers(optimizer)
    for dist_optimizer in patched:
        dist_optimizer.sharded_param_state_fully_reshardable = model_space_state.__get__(dist_optimizer)
    try:
        yield
    finally:
        for dist_optimizer in patched:
            del dist_optimizer.sharded_param_state_fully_reshardable  # the class's method again


@dataclass(frozen=True)
class Piece:
    """The part [start, stop) of a parameter's flattened state that data-parallel rank `rank` holds."""

    rank: int
    start: int
    stop: int


def pieces_of(buffer, param_range: tuple[int, int, int]) -> list[Piece]:
    """Which data-parallel ranks hold which part of a parameter (its (start, stop, bucket) in `buffer`):
    bucket b's grad data is split into equal contiguous ranges, rank r the r-th (as Megatron shards it)."""
    start, stop, bucket_id = param_range
    bucket = buffer.buckets[bucket_id]
    ranks = buffer.data_parallel_group.size()
    width = bucket.grad_data.numel() // ranks
    pieces = []
    for rank in range(ranks):
        low, high = bucket.offset + rank * width, bucket.offset + (rank + 1) * width
        if low < stop and start < high:
            pieces.append(Piece(rank, max(start, low) - start, min(stop, high) - start))
    return pieces


def model_space_state(dist_optimizer, model_sharded_state_dict, is_loading=False, metadata=None) -> dict:
    """`DistributedOptimizer.sharded_param_state_fully_reshardable`'s sharded tensors for a save (the
    parameters' order, keys, shapes, fp32), each on the lowest data-parallel rank holding a piece of its
    parameter, as the main replica there; the other ranks describe none of it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    assert not is_loading, "a save-only path"
    sharded_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata_of = {sharded.data: sharded for sharded in nested_values(sharded_tensors)}
    state_keys = ("param", *dist_optimizer.optimizer_state_keys)
    whole = _whole_states(dist_optimizer, state_keys)
    model_space, index = {}, 0
    for buffer in dist_optimizer.buffers:
        for model_param in buffer.param_index_map:
            states = whole.get(model_param)
            if states is not None:
                sharded = metadata_of[model_param]
                entry = {}
                for key in state_keys:
                    data = states[key].reshape(sharded.data.shape)
                    fields = dict(key=f"optimizer.state.{key}.{sharded.key}", data=data,
                                  replica_id=_main_data_parallel_replica(sharded.replica_id))
                    if not isinstance(sharded, ShardedTensorFactory):  # a factory takes its dtype from `data`
                        fields["dtype"] = data.dtype
                    entry[key] = dataclasses.replace(sharded, **fields)
                    entry[key].validate_metadata_integrity()
                model_space[index] = entry
            index += 1
    return model_space


def _whole_states(dist_optimizer, state_keys) -> dict:
    """Each parameter this rank describes -> {state key: its whole flattened state, fp32}: a view of this
    rank's tensors where it holds all of it, else its neighbours' pieces received and joined."""
    whole, operations, joins = {}, [], []
    for buffer in dist_optimizer.buffers:
        group = buffer.data_parallel_group
        me = group.rank()
        for model_param, param_range in buffer.param_index_map.items():
            pieces = pieces_of(buffer, param_range)
            if all(piece.rank != me for piece in pieces):
                continue
            local = dist_optimizer._get_main_param_and_optimizer_states(model_param)
            local = {key: local[key].detach().float().reshape(-1) for key in state_keys}
            root = pieces[0].rank
            if len(pieces) == 1:
                whole[model_param] = local
            elif me != root:
                peer = dist.get_global_rank(group, root)
                operations += [dist.P2POp(dist.isend, local[key].contiguous(), peer, group) for key in state_keys]
            else:
                parts = {key: [] for key in state_keys}
                for piece in pieces:
                    for key in state_keys:
                        if piece.rank == me:
                            parts[key].append(local[key])
                            continue
                        received = torch.empty(piece.stop - piece.start, dtype=torch.float32,
                                               device=local[key].device)
                        peer = dist.get_global_rank(group, piece.rank)
                        operations.append(dist.P2POp(dist.irecv, received, peer, group))
                        parts[key].append(received)
                joins.append((model_param, parts))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    for model_param, parts in joins:
        whole[model_param] = {key: torch.cat(tensors) for key, tensors in parts.items()}
    return whole


def _main_data_parallel_replica(replica_id):
    """The model parameter's replica id with its data-parallel part (the last) 0: the describing rank's copy
    is the one written, whichever data-parallel rank it is."""
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], 0)
    return 0
