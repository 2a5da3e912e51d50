"""Chunked vocab-parallel logprobs and entropy against the materialised log_softmax path.

The yardstick everywhere is the obvious computation: full logits in fp32, log_softmax, gather.
Checked: values and gradients (world 1, TP2 with and without sequence parallelism), the
GPTModel output-processor hook inside a real tiny model (untied and tied embeddings), bf16, and
the peak memory that motivates the whole thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from skyrl_megatron.compute.logprobs import (
    LogprobOutputProcessor,
    LogprobTargets,
    chunk_tokens_for,
    vocab_parallel_logprobs,
)
from skyrl_megatron.testing import run_on_ranks

SEQ, BATCH, HIDDEN, VOCAB = 8, 3, 16, 48
VALUE_ATOL = 1e-6
GRAD_RTOL = 1e-6


# ---- the yardstick and inputs ------------------------------------------------------------------------


def _reference(hidden, weight, labels, *, temperature=1.0, mask=None):
    """Materialised path: full fp32 logits -> log_softmax -> gather; entropy from the same."""
    return _reference_from_logits(hidden @ weight.t(), labels, temperature=temperature, mask=mask)


def _reference_from_logits(logits, labels, *, temperature, mask=None):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    if mask is not None:
        logprobs, entropy = logprobs * mask, entropy * mask
    return logprobs, entropy


def _problem(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Hidden [s, b, h], weight [V, h], labels and mask [s, b], and loss weights for both outputs.

    Scales keep the logits O(1), like a trained model's, so absolute tolerances are meaningful.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = torch.rand(SEQ, BATCH, generator=gen) > 0.25
    loss_weights = torch.randn(2, SEQ, BATCH, generator=gen)
    return hidden, weight, labels, mask, loss_weights


def _loss(logprobs, entropy, loss_weights):
    return (loss_weights[0] * logprobs).sum() + (loss_weights[1] * entropy).sum()


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _grads(fn, hidden, weight):
    """Gradients of `fn(hidden, weight)` (a scalar) w.r.t. fresh leaf copies of both inputs."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    fn(hidden, weight).backward()
    return hidden.grad, weight.grad


# ---- world 1 -----------------------------------------------------------------------------------------


# `fused`: the generated kernels (torch.compile; on CPU Inductor emits C++), meant for GPU, held to
# the same yardstick as the eager chunks
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])


@FUSED
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_materialised_log_softmax(temperature, fused):
    hidden, weight, labels, mask, _ = _problem()
    result = vocab_parallel_logprobs(
        hidden, weight, labels, mask=mask, temperature=temperature, with_entropy=True, chunk_tokens=5, fused=fused
    )
    ref_logprobs, ref_entropy = _reference(hidden, weight, labels, temperature=temperature, mask=mask)
    assert result.logprobs.shape == labels.shape and result.logprobs.dtype == torch.float32
    assert (result.logprobs - ref_logprobs).abs().max().item() <= VALUE_ATOL
    assert (result.entropy - ref_entropy).abs().max().item() <= VALUE_ATOL
    assert torch.all(result.logprobs[~mask] == 0) and torch.all(result.entropy[~mask] == 0)
    assert torch.all(result.logprobs[mask] < 0) and torch.all(result.entropy[mask] > 0)


def test_without_entropy_and_mask():
    hidden, weight, labels, _, _ = _problem(seed=1)
    result = vocab_parallel_logprobs(hidden, weight, labels, temperature=1.3)
    ref_logprobs, _ = _reference(hidden, weight, labels, temperature=1.3)
    assert result.entropy is None
    assert (result.logprobs - ref_logprobs).abs().max().item() <= VALUE_ATOL


def test_kept_tokens_found_on_the_host_need_no_device_read_and_change_nothing():
    from skyrl_megatron.testing.host_syncs import HostSyncProbe

    # targets are [b, s] with b = 3 padded rows; the head sees Megatron's [s, b], so the host's index must
    # follow that order (a [b, s] index would pick other tokens and this comparison would fail)
    gen = torch.Generator().manual_seed(5)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.rand(BATCH, SEQ, generator=gen) > 0.4
    mask[2] = False  # a row with nothing to score
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    targets = LogprobTargets.on_device(labels, mask, torch.device("cpu"))
    assert torch.equal(targets.kept, mask.t().reshape(-1).nonzero().squeeze(1))

    found_on_device = vocab_parallel_logprobs(hidden, weight, labels.t(), mask=mask.t(), with_entropy=True)
    with HostSyncProbe() as probe:
        from_host = vocab_parallel_logprobs(
            hidden, weight, targets.labels.t(), mask=targets.mask.t(), kept=targets.kept, with_entropy=True
        )
        (from_host.logprobs.sum() + from_host.entropy.sum()).backward()
    assert [s.what for s in probe.found] == []
    assert torch.equal(from_host.logprobs, found_on_device.logprobs)
    assert torch.equal(from_host.entropy, found_on_device.entropy)
    assert torch.all(from_host.logprobs[~mask.t()] == 0) and torch.all(from_host.logprobs[mask.t()] < 0)


@FUSED
@pytest.mark.parametrize("outputs", ["logprobs+entropy", "logprobs", "entropy"])
def test_gradients_match_autograd_through_materialised_path(outputs, fused):
    hidden, weight, labels, mask, loss_weights = _problem(seed=2)
    loss_weights = loss_weights * torch.tensor([outputs != "entropy", outputs != "logprobs"]).view(2, 1, 1)

    def chunked(h, w):
        result = vocab_parallel_logprobs(
            h, w, labels, mask=mask, temperature=0.8, with_entropy=outputs != "logprobs", chunk_tokens=7, fused=fused
        )
        entropy = result.entropy if result.entropy is not None else torch.zeros_like(result.logprobs)
        return _loss(result.logprobs, entropy, loss_weights)

    def materialised(h, w):
        return _loss(*_reference(h, w, labels, temperature=0.8, mask=mask), loss_weights)

    for actual, expected in zip(_grads(chunked, hidden, weight), _grads(materialised, hidden, weight)):
        assert _relative_error(actual, expected) <= GRAD_RTOL
    # masked tokens get no gradient at all
    grad_hidden, _ = _grads(chunked, hidden, weight)
    assert torch.all(grad_hidden[~mask] == 0) and torch.all(grad_hidden[mask].abs().sum(-1) > 0)


def test_chunk_size_does_not_change_results():
    hidden, weight, labels, mask, loss_weights = _problem(seed=3)

    def run(chunk_tokens):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        result = vocab_parallel_logprobs(h, w, labels, mask=mask, with_entropy=True, chunk_tokens=chunk_tokens)
        _loss(result.logprobs, result.entropy, loss_weights).backward()
        return result, h.grad, w.grad

    one_chunk, one_chunk_grad_hidden, one_chunk_grad_weight = run(SEQ * BATCH)
    for chunk_tokens in (1, 4, 7):
        result, grad_hidden, grad_weight = run(chunk_tokens)
        # Each token's statistics come from its own row; only the BLAS kernel may differ with the
        # number of rows (a one-row chunk is a matrix-vector product), and the weight gradient's
        # summation order over chunks. Both move the last bit at most.
        assert (result.logprobs - one_chunk.logprobs).abs().max().item() <= VALUE_ATOL
        assert (result.entropy - one_chunk.entropy).abs().max().item() <= VALUE_ATOL
        assert _relative_error(grad_hidden, one_chunk_grad_hidden) <= GRAD_RTOL
        assert _relative_error(grad_weight, one_chunk_grad_weight) <= GRAD_RTOL


@FUSED
def test_bf16_matches_the_bf16_materialised_path(fused):
    """bf16 weights: same bf16 projection, fp32 statistics; grads come back in bf16."""
    hidden, weight, labels, mask, loss_weights = _problem(seed=4, dtype=torch.bfloat16)
    result = vocab_parallel_logprobs(
        hidden, weight, labels, mask=mask, with_entropy=True, chunk_tokens=5, fused=fused
    )
    ref_logprobs, ref_entropy = _reference(hidden, weight, labels, mask=mask)
    assert result.logprobs.dtype == torch.float32
    assert (result.logprobs - ref_logprobs).abs().max().item() <= VALUE_ATOL
    assert (result.entropy - ref_entropy).abs().max().item() <= VALUE_ATOL

    def chunked(h, w):
        out = vocab_parallel_logprobs(h, w, labels, mask=mask, with_entropy=True, chunk_tokens=5, fused=fused)
        return _loss(out.logprobs, out.entropy, loss_weights)

    def materialised(h, w):
        return _loss(*_reference(h, w, labels, mask=mask), loss_weights)

    for actual, expected in zip(_grads(chunked, hidden, weight), _grads(materialised, hidden, weight)):
        assert actual.dtype == torch.bfloat16
        # one bf16 rounding of the grads (per chunk for the weight): bf16's relative precision is 2^-8
        assert _relative_error(actual, expected) <= 1e-2


def test_fused_kernels_compile_once_for_every_chunk_and_micro_batch_size():
    """Chunks and micro-batches differ in token count; a recompile per count would cost seconds
    per step on GPU (and past Dynamo's recompile limit the kernels would run eagerly)."""
    torch._dynamo.reset()

    def step(tokens: int, with_entropy: bool, temperature: float):
        gen = torch.Generator().manual_seed(tokens)
        h = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_()
        w = torch.randn(VOCAB, HIDDEN, generator=gen).requires_grad_()
        labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
        out = vocab_parallel_logprobs(h, w, labels, temperature=temperature, with_entropy=with_entropy,
                                      chunk_tokens=6, fused=True)
        (out.logprobs.sum() + (out.entropy.sum() if with_entropy else 0)).backward()

    for with_entropy in (True, False):
        # chunks of 6 and 1 tokens: Dynamo specialises a size of 1 (one more graph, once per process)
        step(7, with_entropy, 1.0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for tokens in (4, 17, 31):
            for with_entropy in (True, False):
                step(tokens, with_entropy, 0.6)


def _chunk_calls(monkeypatch):
    """Per chunk call, forward and backward, whether it had kept logits (a spy on both chunk functions)."""
    from skyrl_megatron.compute import logprobs

    calls = {"forward": [], "backward": []}
    forward_chunk, backward_chunk = logprobs._forward_chunk, logprobs._backward_chunk

    def spy_forward(*args, logits_out=None, **kwargs):
        calls["forward"].append(logits_out is not None)
        return forward_chunk(*args, logits_out=logits_out, **kwargs)

    def spy_backward(*args, logits=None, **kwargs):
        calls["backward"].append(logits is not None)
        return backward_chunk(*args, logits=logits, **kwargs)

    monkeypatch.setattr(logprobs, "_forward_chunk", spy_forward)
    monkeypatch.setattr(logprobs, "_backward_chunk", spy_backward)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_kept_for_the_backward_change_nothing(dtype, monkeypatch):
    """Kept logits (all of them, whole chunks up to the budget, none) give the recompute's values and grads
    bitwise; the fp32 eager statistics, which work in their input's buffer, get a copy of a kept chunk."""
    hidden, weight, labels, mask, loss_weights = _problem(seed=8, dtype=dtype)
    calls = _chunk_calls(monkeypatch)
    kept_tokens = int(mask.sum())
    chunks = -(-kept_tokens // 5)  # 5-token chunks, the last one partial
    assert kept_tokens % 5 and chunks > 3
    row_bytes = VOCAB * dtype.itemsize

    def run(kept_bytes):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = vocab_parallel_logprobs(h, w, labels, mask=mask, temperature=0.9, with_entropy=True, chunk_tokens=5,
                                      kept_logits_bytes=kept_bytes)
        _loss(out.logprobs, out.entropy, loss_weights).backward()
        return out.logprobs, out.entropy, h.grad, w.grad

    recomputed = run(0)
    assert calls["forward"] == calls["backward"] == [False] * chunks
    for kept_bytes, kept_chunks in ((kept_tokens * row_bytes, chunks), (13 * row_bytes, 2)):
        calls["forward"].clear(), calls["backward"].clear()
        for got, want in zip(run(kept_bytes), recomputed):
            assert torch.equal(got, want)
        assert calls["forward"] == calls["backward"] == [True] * kept_chunks + [False] * (chunks - kept_chunks)


def test_logits_are_kept_only_where_a_backward_can_follow(monkeypatch):
    hidden, weight, labels, mask, _ = _problem(seed=9)
    calls = _chunk_calls(monkeypatch)
    with torch.no_grad():
        vocab_parallel_logprobs(hidden.requires_grad_(), weight, labels, mask=mask, chunk_tokens=5,
                                kept_logits_bytes=2**30)
    vocab_parallel_logprobs(hidden.detach(), weight, labels, mask=mask, chunk_tokens=5, kept_logits_bytes=2**30)
    assert calls["forward"] and not any(calls["forward"])


def test_a_second_backward_recomputes_the_consumed_logits():
    hidden, weight, labels, mask, loss_weights = _problem(seed=10)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_logprobs(h, w, labels, mask=mask, with_entropy=True, chunk_tokens=5, kept_logits_bytes=2**30)
    loss = _loss(out.logprobs, out.entropy, loss_weights)
    loss.backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    loss.backward()
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])


def _weight_with_main_grad(weight, main_grad_dtype=torch.float32, **marks):
    """`weight` as Megatron's DDP hands it over: a `main_grad` buffer (holding an earlier micro-batch's sum)
    and the flag its hook reads."""
    leaf = weight.clone().requires_grad_()
    leaf.main_grad = torch.full(weight.shape, 0.25, dtype=main_grad_dtype)
    leaf.grad_added_to_main_grad = False
    for name, value in marks.items():
        setattr(leaf, name, value)
    return leaf


@pytest.mark.parametrize("tied", [False, True], ids=["output_weight", "tied_embedding"])
def test_the_weight_gradient_accumulates_into_main_grad(tied):
    """Under gradient_accumulation_fusion the head adds its fp32 weight gradient into `main_grad` (no bf16
    rounding, no cast) and marks the weight; the placeholder gradient is zeros for a weight shared with the
    embedding (Megatron's `zero_out_wgrad`), whose own gradient DDP's hook then adds."""
    hidden, weight, labels, mask, loss_weights = _problem(seed=11, dtype=torch.bfloat16)
    _, expected = _grads(lambda h, w: _loss(*_reference(h.float(), w.float(), labels, mask=mask), loss_weights),
                         hidden, weight)
    leaf = _weight_with_main_grad(weight, **({"zero_out_wgrad": True} if tied else {}))
    out = vocab_parallel_logprobs(hidden.clone().requires_grad_(), leaf, labels, mask=mask, with_entropy=True,
                                  chunk_tokens=5, into_main_grad=True)
    _loss(out.logprobs, out.entropy, loss_weights).backward()
    assert leaf.grad_added_to_main_grad
    assert _relative_error(leaf.main_grad - 0.25, expected) <= 1e-2  # bf16 GEMM inputs, fp32 sums
    if tied:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_a_bf16_main_grad_or_no_fusion_leaves_the_gradient_to_ddps_hook():
    hidden, weight, labels, mask, loss_weights = _problem(seed=12, dtype=torch.bfloat16)
    for main_grad_dtype, into_main_grad in ((torch.bfloat16, True), (torch.float32, False)):
        leaf = _weight_with_main_grad(weight, main_grad_dtype)
        out = vocab_parallel_logprobs(hidden, leaf, labels, mask=mask, chunk_tokens=5, into_main_grad=into_main_grad)
        out.logprobs.sum().backward()
        assert not leaf.grad_added_to_main_grad and torch.all(leaf.main_grad == 0.25)
        assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.abs().sum() > 0


def test_kept_tokens_are_whole_chunks_within_the_budget():
    from skyrl_megatron.compute.logprobs import kept_logits_tokens

    assert kept_logits_tokens(100, 30, 1000, 2, 100 * 1000 * 2) == 100  # all of it fits: the partial chunk too
    assert kept_logits_tokens(100, 30, 1000, 2, 100 * 1000 * 2 - 1) == 90
    assert kept_logits_tokens(100, 30, 1000, 2, 59 * 1000 * 2) == 30
    assert kept_logits_tokens(100, 30, 1000, 2, 0) == 0


def test_chunk_tokens_follow_the_byte_budget():
    assert chunk_tokens_for(32768, 256 * 2**20) == 2048
    assert chunk_tokens_for(151936 // 8, 2**30) == 14134
    assert chunk_tokens_for(10**9, 1) == 1


# ---- tensor parallel ---------------------------------------------------------------------------------


def _tensor_parallel_rank(rank, world_size):
    """Values and grads of this rank's shards, with and without sequence parallelism, eager and
    with the generated kernels (one spawn)."""
    from skyrl_megatron.parallel import init_distributed

    init_distributed("cpu")  # Megatron's TP mappings allocate on "cuda"; the CPU runtime redirects that
    hidden, weight, labels, mask, loss_weights = _problem(seed=5)
    vocab_shard = slice(rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size)
    seq_shard = slice(rank * SEQ // world_size, (rank + 1) * SEQ // world_size)
    results = {}
    for sequence_parallel, fused in ((False, False), (True, False), (False, True)):
        local_hidden = (hidden[seq_shard] if sequence_parallel else hidden).clone().requires_grad_()
        local_weight = weight[vocab_shard].clone().requires_grad_()
        result = vocab_parallel_logprobs(
            local_hidden,
            local_weight,
            labels,
            mask=mask,
            temperature=0.9,
            with_entropy=True,
            tp_group=dist.group.WORLD,
            sequence_parallel=sequence_parallel,
            chunk_tokens=5,
            fused=fused,
        )
        _loss(result.logprobs, result.entropy, loss_weights).backward()
        results[sequence_parallel, fused] = {
            "logprobs": result.logprobs,
            "entropy": result.entropy,
            "grad_hidden": local_hidden.grad,
            "grad_weight": local_weight.grad,
            "vocab_shard": vocab_shard,
            "seq_shard": seq_shard if sequence_parallel else slice(None),
        }
    return results


@pytest.mark.slow
def test_tensor_parallel_with_and_without_sequence_parallel_matches_world_one():
    """The fused path's shards sum against their own max and are rescaled to the global one: its
    TP2 case checks that combination against world 1."""
    hidden, weight, labels, mask, loss_weights = _problem(seed=5)
    hidden.requires_grad_()
    weight.requires_grad_()
    expected = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, temperature=0.9, with_entropy=True)
    _loss(expected.logprobs, expected.entropy, loss_weights).backward()

    for by_layout in run_on_ranks(_tensor_parallel_rank, 2, timeout=120):
        for (sequence_parallel, fused), rank in by_layout.items():
            expected_grad_hidden = hidden.grad[rank["seq_shard"]]
            expected_grad_weight = weight.grad[rank["vocab_shard"]]
            layout = f"sequence_parallel={sequence_parallel} fused={fused}"
            assert (rank["logprobs"] - expected.logprobs).abs().max().item() <= VALUE_ATOL, layout
            assert (rank["entropy"] - expected.entropy).abs().max().item() <= VALUE_ATOL, layout
            assert rank["grad_hidden"].shape == expected_grad_hidden.shape
            assert _relative_error(rank["grad_hidden"], expected_grad_hidden) <= GRAD_RTOL, layout
            assert _relative_error(rank["grad_weight"], expected_grad_weight) <= GRAD_RTOL, layout


# ---- inside a real Megatron model ----------------------------------------------------------------------

MODEL_TEMPERATURE = 0.7
MODEL_VALUE_ATOL = 1e-5


def _model_rank(rank, world_size, checkpoints: dict, layout: dict):
    """Per checkpoint: logprobs/entropy and all parameter grads, through the hook and through logits."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (2, 12), generator=gen)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    labels = torch.roll(tokens, -1, dims=1)  # position t scores token t+1
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, -1] = False  # the last position has no next token
    mask[1, :3] = False  # and a few "prompt" positions are not scored
    loss_weights = torch.randn(2, *tokens.shape, generator=gen)

    results = {}
    for name, hf_dir in checkpoints.items():
        model = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32")).chunks[0]
        params = dict(model.named_parameters())

        def grads_of(loss):
            for param in params.values():
                param.grad = None
            loss.backward()
            return {key: param.grad.clone() for key, param in params.items()}

        processor = LogprobOutputProcessor(temperature=MODEL_TEMPERATURE, with_entropy=True, logits_chunk_bytes=4096)
        hooked = model(
            tokens,
            positions,
            None,
            output_processor=processor,
            output_processor_context=LogprobTargets(labels, mask),
        )
        logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))
        plain = _reference_from_logits(logits, labels, temperature=MODEL_TEMPERATURE, mask=mask)
        results[name] = {
            "hooked": (hooked.logprobs.detach(), hooked.entropy.detach()),
            "plain": tuple(t.detach() for t in plain),
            "hooked_grads": grads_of(_loss(hooked.logprobs, hooked.entropy, loss_weights)),
            "plain_grads": grads_of(_loss(*plain, loss_weights)),
            "tied": model.share_embeddings_and_output_weights,
        }
    return results


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from skyrl_megatron.testing import make_tiny_hf_model

    out = tmp_path_factory.mktemp("logprob_models")
    return {
        "untied": str(make_tiny_hf_model("qwen3", out / "untied", seed=11)),
        "tied": str(make_tiny_hf_model("qwen3", out / "tied", seed=12, tie_word_embeddings=True)),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout", [(1, {}), (2, {"tensor": 2, "sequence_parallel": True})], ids=["world1", "tp2_sp"]
)
def test_model_output_processor_matches_log_softmax_of_logits(tiny_checkpoints, world, layout):
    for rank in run_on_ranks(_model_rank, world, tiny_checkpoints, layout, timeout=300):
        assert rank["tied"]["tied"] and not rank["untied"]["tied"]
        for name, result in rank.items():
            for hooked, plain in zip(result["hooked"], result["plain"]):
                assert hooked.shape == (2, 12)
                assert (hooked - plain).abs().max().item() <= MODEL_VALUE_ATOL, name
            assert result["hooked_grads"].keys() == result["plain_grads"].keys()
            for key, grad in result["hooked_grads"].items():
                assert _relative_error(grad, result["plain_grads"][key]) <= 1e-5, (name, key)


# ---- memory ------------------------------------------------------------------------------------------

MEMORY_TOKENS, MEMORY_VOCAB, MEMORY_HIDDEN = 8192, 32768, 64


def _peak_memory_rank(rank, world_size, path: str) -> dict[str, int]:
    """Peak resident memory (bytes) that one logprob pass adds on top of its inputs, without and
    with backward.

    Runs in a fresh process (run_on_ranks spawns one), so earlier tests' allocations cannot blur
    the numbers. Linux's peak RSS (VmHWM) is reset through /proc/self/clear_refs before each pass;
    the pass's peak is VmHWM minus the RSS at that moment. Tensors this large are mmap-backed on
    CPU and unmapped when freed, so RSS counts what a pass really touched, and the first pass
    leaves nothing behind for the second.
    """
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(MEMORY_TOKENS, MEMORY_HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(MEMORY_VOCAB, MEMORY_HIDDEN, generator=gen) / MEMORY_HIDDEN**0.5).requires_grad_()
    labels = torch.randint(0, MEMORY_VOCAB, (MEMORY_TOKENS,), generator=gen)

    def logprobs():
        if path == "materialised":
            log_probs = torch.log_softmax(hidden @ weight.t(), dim=-1)
            return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return vocab_parallel_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens_for(MEMORY_VOCAB, 256 * 2**20)).logprobs

    peaks = {}
    for name, with_backward in (("forward", False), ("forward_backward", True)):
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        baseline = _proc_status_bytes("VmRSS")
        with torch.set_grad_enabled(with_backward):
            result = logprobs()
            if with_backward:
                result.sum().backward()
        del result
        peaks[name] = _proc_status_bytes("VmHWM") - baseline
    return peaks


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.slow
def test_chunked_peak_memory_is_below_a_third_of_materialised():
    """vocab 32k, 8k tokens: one fp32 [tokens, vocab] tensor is 1 GiB, chunked at 256 MiB (the default
    chunk, 1 GiB, would hold it whole)."""
    peaks = {path: run_on_ranks(_peak_memory_rank, 1, path, timeout=300)[0] for path in ("materialised", "chunked")}
    for path, by_pass in peaks.items():
        print(path, {name: f"{peak / 2**20:.0f} MiB" for name, peak in by_pass.items()})
    full_logits_bytes = 4 * MEMORY_TOKENS * MEMORY_VOCAB
    for name in ("forward", "forward_backward"):
        assert peaks["materialised"][name] >= full_logits_bytes  # the yardstick really materialised the logits
        assert peaks["chunked"][name] <= peaks["materialised"][name] / 3, name
