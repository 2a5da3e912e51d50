"""Our core attention and the packed / context-parallel layouts, against explicit causal softmax.

The yardstick is the obvious computation in float64: per sequence, scores = q k^T * scale, a causal
mask, softmax, times v (K/V heads repeated for GQA). Checked: the segment kernel (CPU masked SDPA)
for packed sequences and for simulated CP ranks; the Megatron module padded / packed / CP2 over gloo
(values and gradients, so the K/V all-gather's backward is covered); packing and CP slicing round
trips; and a whole tiny model, packed THD against padded, sequence by sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_megatron.attention_kernels import SegmentKernel
from skyrl_megatron.compute.microbatch.pack import pack_padded_batch, unpack_to_padded
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit, context_parallel_index
from skyrl_megatron.parallel import ParallelConfig
from skyrl_megatron.testing import run_on_ranks

HEADS, GROUPS, HEAD_DIM = 4, 2, 8
SCALE = 1.0 / math.sqrt(HEAD_DIM)
ATOL = 1e-5
MASKED_SDPA = SegmentKernel.MASKED_SDPA  # the CPU runtime's segment kernel (what `auto` picks there)


# ---- the yardstick -----------------------------------------------------------------------------------


def _reference(query, key, value, seq_lengths):
    """Explicit causal softmax per packed sequence, in float64. q [T, heads, d], k/v [T, groups, d]."""
    outputs, start = [], 0
    for length in seq_lengths:
        q, k, v = (x[start : start + length].double().transpose(0, 1) for x in (query, key, value))
        k, v = (x.repeat_interleave(HEADS // GROUPS, dim=0) for x in (k, v))
        scores = (q @ k.transpose(1, 2)) * SCALE
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        outputs.append((probs @ v).transpose(0, 1))
        start += length
    return torch.cat(outputs).to(query.dtype)


def _qkv(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen),
        torch.randn(num_tokens, GROUPS, HEAD_DIM, generator=gen),
        torch.randn(num_tokens, GROUPS, HEAD_DIM, generator=gen),
    )


# ---- the segment kernel, in process ------------------------------------------------------------------


def test_causal_mask_is_bottom_right_aligned_per_segment():
    from skyrl_megatron.model.layers.attention import CausalSegments, segment_causal_mask

    # two segments: 2 queries against 3 keys, then 1 query against 1 key
    cu_q, cu_k = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32)
    mask = segment_causal_mask(CausalSegments(cu_q, cu_k, 2, 3))
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_packed_segments_match_reference_with_gqa():
    from skyrl_megatron.model.layers.attention import CausalSegments, attend_segments

    seq_lengths = [5, 1, 9, 3]
    query, key, value = _qkv(sum(seq_lengths))
    cu = torch.tensor([0, *seq_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    output = attend_segments(query, key, value, CausalSegments(cu, cu, 9, 9), SCALE, kernel=MASKED_SDPA)
    expected = _reference(query, key, value, seq_lengths)
    assert output.shape == query.shape
    assert (output - expected).abs().max().item() <= ATOL
    # packing must isolate sequences: attending over one unsegmented row changes later sequences
    whole = torch.tensor([0, sum(seq_lengths)], dtype=torch.int32)
    unsegmented = attend_segments(query, key, value, CausalSegments(whole, whole, 18, 18), SCALE, kernel=MASKED_SDPA)
    assert (unsegmented[5:] - expected[5:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_segments_reproduce_full_attention(cp_size):
    """Every simulated CP rank's local queries against the rank-major gathered K/V give the rows of
    the unsplit result."""
    from skyrl_megatron.model.layers.attention import attend_segments, context_parallel_segments

    seq_lengths = (8 * cp_size, 2 * cp_size, 4 * cp_size)
    query, key, value = _qkv(sum(seq_lengths), seed=1)
    expected = _reference(query, key, value, seq_lengths)
    local = [context_parallel_index(seq_lengths, rank, cp_size) for rank in range(cp_size)]
    gathered_key, gathered_value = (torch.cat([x[index] for index in local]) for x in (key, value))
    for rank, index in enumerate(local):
        segments = context_parallel_segments(seq_lengths, rank, cp_size, torch.device("cpu"))
        output = attend_segments(query[index], gathered_key, gathered_value, segments, SCALE, kernel=MASKED_SDPA)
        assert (output - expected[index]).abs().max().item() <= ATOL


# ---- packing and CP layouts --------------------------------------------------------------------------


def _skyrl_batch():
    """A [B, S] batch like skyrl-train's: left-padded prompt, right-padded response, real ids >= 1."""
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
        ]
    )
    tokens = torch.randint(1, 100, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    return tokens, mask


@pytest.mark.parametrize(
    "parallel,expected_padded",
    [
        (ParallelConfig(), (5, 10, 2)),
        (ParallelConfig(context=2), (8, 12, 4)),  # each a multiple of 2*CP
        (ParallelConfig(tensor=4, context=2, sequence_parallel=True), (8, 12, 12)),  # T a multiple of 2*CP*TP
        (ParallelConfig(tensor=4, sequence_parallel=True), (5, 10, 5)),  # T a multiple of TP
    ],
)
def test_pack_unpack_round_trip(parallel, expected_padded):
    tokens, mask = _skyrl_batch()
    packed = pack_padded_batch(tokens, mask, parallel, pad_token_id=0)
    assert packed.seq_lengths == (5, 10, 2)
    assert packed.seq_lengths_padded == expected_padded
    cu = torch.tensor([0, *expected_padded]).cumsum(0)
    params = packed.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(params.cu_seqlens_q.long(), cu) and torch.equal(params.cu_seqlens_kv_padded.long(), cu)
    assert params.max_seqlen_q == max(expected_padded)
    # each sequence: its real tokens in order, then padding; positions restart at 0
    for i, start in enumerate(cu[:-1].tolist()):
        real = tokens[i][mask[i].bool()]
        length = expected_padded[i]
        assert torch.equal(packed.tokens[0, start : start + len(real)], real)
        assert not packed.tokens[0, start + len(real) : start + length].any()
        assert torch.equal(packed.position_ids[0, start : start + length], torch.arange(length))
    # per-token outputs (here the tokens themselves, with a feature dim) return to their positions
    features = torch.stack([packed.tokens, -packed.tokens], dim=-1).float()
    restored = unpack_to_padded(features, packed, fill_value=-7.0)
    assert restored.shape == (*tokens.shape, 2)
    assert torch.equal(restored[..., 0][mask.bool()], tokens[mask.bool()].float())
    assert torch.equal(restored[..., 1][mask.bool()], -tokens[mask.bool()].float())
    assert (restored[~mask.bool()] == -7.0).all()


def test_context_parallel_index_is_megatrons_load_balanced_split():
    # one sequence of 8 over CP 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert context_parallel_index([8], 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_index([8], 1, 2).tolist() == [2, 3, 4, 5]
    # packed: split sequence by sequence
    assert context_parallel_index([4, 8], 1, 2).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="multiple of 2\\*CP"):
        context_parallel_index([6], 0, 2)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_split_round_trip(cp_size):
    tokens, mask = _skyrl_batch()
    packed = pack_padded_batch(tokens, mask, ParallelConfig(context=cp_size))
    padded = torch.arange(3 * 8 * cp_size).reshape(3, 8 * cp_size)
    for split, full in [
        (lambda r: ContextParallelSplit.for_packed(packed.packed_seq_params, r, cp_size), packed.tokens),
        (lambda r: ContextParallelSplit.for_padded(padded.shape[1], r, cp_size), padded),
    ]:
        locals_ = [split(rank).local(full) for rank in range(cp_size)]
        assert all(part.shape[1] == full.shape[1] // cp_size for part in locals_)
        # every token is held by exactly one rank, and the rank-major gather restores global order
        assert torch.equal(split(0).restore_global_order(torch.cat(locals_, dim=1)), full)


# ---- the Megatron module over gloo -------------------------------------------------------------------


def _attention_module(cp_size: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_megatron.model.layers.attention import CoreAttention
    from skyrl_megatron.parallel import init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(context=cp_size))
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        context_parallel_size=cp_size,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return CoreAttention(config, 1, AttnMaskType.causal, "self")


def _thd_to_sbhd(x, batch: int):
    """Equal-length sequences laid end to end [b * s, ...] -> [s, b, ...]."""
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:]).transpose(0, 1)


def _module_values_and_grads(rank, world_size, seq_lengths, padded_batch):
    """Forward + backward of the module on this CP rank's share of fixed global inputs (THD, or a
    padded batch of `padded_batch` rows); returns global-order outputs and local input grads."""
    from megatron.core import parallel_state as ps

    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch

    attention = _attention_module(world_size)
    query, key, value = _qkv(sum(seq_lengths), seed=2)
    grad_output = torch.randn(query.shape[0], HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    split = ContextParallelSplit(tuple(seq_lengths), ps.get_context_parallel_rank(), world_size)
    inputs = [split.local(x, dim=0).requires_grad_() for x in (query, key, value)]
    if padded_batch:
        seq = seq_lengths[0] // world_size
        output = attention(*(_thd_to_sbhd(x, padded_batch) for x in inputs), None)
        assert output.shape == (seq, padded_batch, HEADS * HEAD_DIM)
        output = output.transpose(0, 1).reshape(-1, HEADS * HEAD_DIM)
    else:
        lengths = torch.tensor(seq_lengths)
        mask = torch.arange(max(seq_lengths))[None, :] < lengths[:, None]
        packed = pack_padded_batch(mask.long(), mask, ParallelConfig(context=world_size))
        assert packed.seq_lengths_padded == tuple(seq_lengths)
        output = attention(*inputs, None, packed_seq_params=packed.packed_seq_params)
    (output * split.local(grad_output, dim=0)).sum().backward()
    return {
        "output": split.gather(output.detach(), ps.get_context_parallel_group(), dim=0),
        "grads": [x.grad for x in inputs],
        "local_index": context_parallel_index(seq_lengths, split.cp_rank, world_size),
    }


def _expected_values_and_grads(seq_lengths):
    query, key, value = (x.double().requires_grad_() for x in _qkv(sum(seq_lengths), seed=2))
    grad_output = torch.randn(query.shape[0], HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    output = _reference(query, key, value, seq_lengths).reshape(query.shape[0], -1)
    (output * grad_output.double()).sum().backward()
    return output.float(), [x.grad.float() for x in (query, key, value)]


MODULE_CASES = {
    "padded-world1": (1, (12, 12, 12), 3),
    "packed-world1": (1, (5, 12, 1), 0),
    "padded-cp2": (2, (12, 12, 12), 3),
    "packed-cp2": (2, (8, 12, 4), 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("world,seq_lengths,padded_batch", MODULE_CASES.values(), ids=MODULE_CASES.keys())
def test_module_values_and_grads_match_reference(world, seq_lengths, padded_batch):
    results = run_on_ranks(_module_values_and_grads, world, seq_lengths, padded_batch, timeout=300)
    expected_output, expected_grads = _expected_values_and_grads(seq_lengths)
    for result in results:
        assert (result["output"] - expected_output).abs().max().item() <= ATOL
        for grad, expected in zip(result["grads"], expected_grads):
            assert (grad - expected[result["local_index"]]).abs().max().item() <= ATOL


# ---- a whole tiny model: packed against padded --------------------------------------------------------

MODEL_SEQ_LENGTHS = (7, 12, 3, 9)


def _packed_and_padded_logits(rank, world_size, hf_dir: str):
    """Logits of the same sequences, once right-padded [B, S] and once packed from a skyrl-style
    left/right-padded batch. Returns both at the real tokens, sequence by sequence."""
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.layers.attention import CoreAttention
    from skyrl_megatron.parallel import init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig())
    model = build_model(ModelSpec(hf_dir, dtype="fp32")).chunks[0]
    model.eval()
    assert all(
        isinstance(layer.self_attention.core_attention, CoreAttention) for layer in model.decoder.layers
    ), "the local layer spec must use our core attention"

    seq, batch = max(MODEL_SEQ_LENGTHS), len(MODEL_SEQ_LENGTHS)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(1, 256, (n,), generator=gen) for n in MODEL_SEQ_LENGTHS]
    right_padded = torch.zeros(batch, seq, dtype=torch.long)
    skyrl_style = torch.zeros(batch, seq + 4, dtype=torch.long)  # shifted right by a left pad
    skyrl_mask = torch.zeros_like(skyrl_style)
    for i, tokens in enumerate(sequences):
        right_padded[i, : len(tokens)] = tokens
        left = i % 3
        skyrl_style[i, left : left + len(tokens)] = tokens
        skyrl_mask[i, left : left + len(tokens)] = 1

    with torch.no_grad():
        padded_logits = model(right_padded, torch.arange(seq).expand(batch, seq), None)
        packed = pack_padded_batch(skyrl_style, skyrl_mask)
        packed_logits = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
    unpacked = unpack_to_padded(packed_logits, packed)
    return {
        "padded": [padded_logits[i, :n] for i, n in enumerate(MODEL_SEQ_LENGTHS)],
        "packed": [unpacked[i][skyrl_mask[i].bool()] for i in range(batch)],
    }


@pytest.mark.slow
def test_packed_model_forward_matches_padded_per_sequence(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    make_tiny_hf_model("qwen3", tmp_path, seed=4)
    (result,) = run_on_ranks(_packed_and_padded_logits, 1, str(tmp_path), timeout=300)
    for padded, packed in zip(result["padded"], result["packed"]):
        assert padded.shape == packed.shape
        assert (padded - packed).abs().max().item() <= 1e-5


def test_context_parallel_reads_sequence_lengths_back_once_per_micro_batch():
    """Under CP every layer needs the micro-batch's sequence lengths on the host; on a GPU reading them back
    waits for the device, so they are read once per boundary tensor (one per micro-batch), not per layer."""
    from skyrl_megatron.model.layers.attention import _SequenceLengthsOnHost

    lengths = _SequenceLengthsOnHost()
    boundaries = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert lengths.of(boundaries) == (4, 8)
    boundaries.copy_(torch.tensor([0, 2, 12]))  # the same tensor is not read again
    assert lengths.of(boundaries) == (4, 8)
    assert lengths.of(torch.tensor([0, 2, 12], dtype=torch.int32)) == (2, 10)  # the next micro-batch's
