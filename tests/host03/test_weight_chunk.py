"""Our weight bucket in skyrl-train 0.3.1's `WeightChunk`, what its transfer strategies send (skyrl 0.4
takes our weights through our own broadcast group or its vLLM `WeightSource`: tests/host04). The weight
export itself: tests/test_weights.py."""

from __future__ import annotations

import torch


def test_weight_chunk_carries_the_bucket_to_the_host():
    from skyrl_megatron.host_api import weight_chunk
    from skyrl_megatron.weights import WeightBucket

    tensors = [torch.ones(3, 4, dtype=torch.bfloat16), torch.zeros(5)]
    bucket = WeightBucket.of(["a.weight", "b.bias"], tensors)
    chunk = weight_chunk(bucket)
    assert chunk.names == ["a.weight", "b.bias"]
    assert chunk.dtypes == ["torch.bfloat16", "torch.float32"] and chunk.shapes == [[3, 4], [5]]
    assert chunk.tensors[0] is tensors[0] and len(chunk) == len(bucket) == 2
    assert chunk.total_size_bytes == bucket.nbytes == 3 * 4 * 2 + 5 * 4
