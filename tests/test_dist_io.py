"""dist_io.fast_shard_bookkeeping: torch's overlap check of ShardedTensor shards gives the same
answers with our sweep, without the quadratic search on MoE expert grids."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import _internals

from skyrl_megatron.dist_io import _overlapping_pair, fast_shard_bookkeeping


def _expert_grid(layers: int, experts: int, row_pieces: int, rows: int = 32, cols: int = 16):
    """Megatron's MoE fc1 layout: [layers, experts, rows, cols], one shard per layer, expert and row piece."""
    return [
        ShardMetadata([layer, expert, piece * rows, 0], [1, 1, rows, cols], "rank:0/cpu")
        for layer, expert, piece in itertools.product(range(layers), range(experts), range(row_pieces))
    ]


def _random_boxes(seed: int, count: int, overlap: bool):
    """Random 3-D boxes on a coarse grid (distinct cells), with one overlapping box added if asked."""
    rng = random.Random(seed)
    cells = rng.sample(list(itertools.product(range(6), range(5), range(4))), count)
    boxes = [ShardMetadata([a * 4, b * 3, c * 2], [4, 3, 2], "rank:0/cpu") for a, b, c in cells]
    if overlap:
        a, b, c = cells[rng.randrange(count)]
        boxes.insert(rng.randrange(count), ShardMetadata([a * 4 + 1, b * 3 + 1, c * 2], [2, 1, 1], "rank:0/cpu"))
    return boxes


def _sharded_dims(shards):
    return [d for d in range(len(shards[0].shard_offsets)) if len({s.shard_offsets[d] for s in shards}) > 1]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("overlap", [False, True])
def test_same_answer_as_torch(seed, overlap):
    shards = _random_boxes(seed, 30, overlap)
    dims = _sharded_dims(shards)
    theirs, ours = _internals._find_nd_overlapping_shards(shards, dims), _overlapping_pair(shards, dims)
    assert (theirs is None) == (ours is None) == (not overlap)
    if ours is not None:
        assert _internals._check_shard_metadata_pair_overlap(shards[ours[0]], shards[ours[1]])


def test_expert_grid_is_not_searched_pairwise(monkeypatch):
    """48 layers x 128 experts x (gate, up): torch's sweep compares each shard with half of all others."""
    shards = _expert_grid(layers=48, experts=128, row_pieces=2)
    calls = {"n": 0}
    real = _internals._check_shard_metadata_pair_overlap

    def counting(a, b):
        calls["n"] += 1
        return real(a, b)

    monkeypatch.setattr(_internals, "_check_shard_metadata_pair_overlap", counting)
    with fast_shard_bookkeeping():
        _internals.validate_non_overlapping_shards_metadata(shards)  # raises on an overlap
    assert calls["n"] <= 100 * len(shards)  # one expert's 96 shards open at a time, not 6,144
    shards.append(ShardMetadata([47, 127, 16, 0], [1, 1, 32, 16], "rank:0/cpu"))  # overlaps two shards
    with fast_shard_bookkeeping(), pytest.raises(ValueError, match="overlap"):
        _internals.validate_non_overlapping_shards_metadata(shards)
    assert _internals._find_nd_overlapping_shards is not _overlapping_pair  # restored


def test_shard_lookup_by_offset_equals_torchs_scan():
    """The save's per-shard lookup: the same shard as torch's scan, and torch's error for a missing one."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.checkpoint import utils as checkpoint_utils
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from skyrl_megatron.dist_io import fast_shard_bookkeeping

    metadata = _expert_grid(layers=3, experts=4, row_pieces=2)
    shards = [SimpleNamespace(metadata=m, tensor=torch.full((1,), float(i))) for i, m in enumerate(metadata)]
    tensor = SimpleNamespace(local_shards=lambda: shards)  # what `_find_shard` reads of a ShardedTensor
    torchs = checkpoint_utils._find_shard
    indices = [MetadataIndex("w", m.shard_offsets) for m in reversed(metadata)]
    with fast_shard_bookkeeping():
        assert checkpoint_utils._find_shard is not torchs
        for index in indices:
            assert checkpoint_utils._find_shard(tensor, index) is torchs(tensor, index)
        with pytest.raises(ValueError, match="Could not find shard"):
            checkpoint_utils._find_shard(tensor, MetadataIndex("w", [9, 9, 9, 9]))
    assert checkpoint_utils._find_shard is torchs
