"""The logprob head with its statistics in the GEMM's epilogue (`fused_kernels: [lse_gemm]`, compute/logprob_gemm.py).

quack's epilogue GEMM runs on Hopper or later GPUs only. Here its PyTorch stand-in, `logprob_gemm.reference_statistics`
(the fp32 product, its log-sum-exp and label column, the logits rounded where they are stored), takes its place in
the head, so what is checked is everything around the kernel: logprobs from the accumulator are closer to exact than
the two-kernel path's, scoring passes (no logits written) and training forwards (logits stored for the backward and
the entropy) give the same logprobs bit for bit, the entropy and the gradients follow the stored logits as before,
the vocabulary-parallel combination, what is handed to quack, and when the kernel is not taken.
`bench/gpu_lse_gemm.py` runs quack's kernel itself against fp64 and the two-kernel path on a GPU.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.distributed as dist

from skyrl_megatron.compute import logprob_gemm, logprobs
from skyrl_megatron.compute.logprobs import vocab_parallel_logprobs
from skyrl_megatron.testing import run_on_ranks

SEQ, BATCH, HIDDEN, VOCAB = 8, 3, 64, 48


def _use_stand_in() -> None:
    """Put the stand-in where quack's kernel goes (this process, every device)."""
    original = logprobs._chunk_kernels

    def chunk_kernels(fused, device, lse_gemm=False):
        kernels = original(fused, device)
        if lse_gemm:
            kernels = dataclasses.replace(kernels, lse_gemm=logprob_gemm.reference_statistics,
                                          lse_gemm_takes=lambda hidden, weight, temperature: temperature == 1.0)
        return kernels

    logprobs._chunk_kernels = chunk_kernels


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(logprobs, "_chunk_kernels", logprobs._chunk_kernels)  # restored after the test
    _use_stand_in()


def _problem(seed: int = 0, dtype=torch.bfloat16, logit_scale: float = 8.0):
    """Hidden [s, b, h], weight [V, h], labels and mask [s, b]; logits of a few units to tens, like a trained
    model's, where bf16's rounding of a logit is worth hundredths."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * logit_scale / HIDDEN**0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    mask = torch.rand(SEQ, BATCH, generator=gen) > 0.25
    return hidden, weight, labels, mask


def _exact_logprobs(hidden, weight, labels, mask):
    log_probs = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * mask


def test_logprobs_come_from_the_accumulator_closer_to_exact_than_rounded_logits(stand_in):
    hidden, weight, labels, mask = _problem()
    exact = _exact_logprobs(hidden, weight, labels, mask)
    from_accumulator = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, chunk_tokens=5, lse_gemm=True)
    two_kernels = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, chunk_tokens=5)
    accumulator_error = (from_accumulator.logprobs.double() - exact).abs().max().item()
    rounded_error = (two_kernels.logprobs.double() - exact).abs().max().item()
    assert accumulator_error <= 1e-5
    assert rounded_error > 1e-3 and accumulator_error < rounded_error / 100
    assert torch.all(from_accumulator.logprobs[~mask] == 0)


def test_scoring_and_training_forwards_give_the_same_logprobs_bit_for_bit(stand_in):
    """A scoring pass writes no logits; a training forward stores them (all, some or none kept for the backward) and
    reads them for the entropy: the logprobs, which meet in the importance ratio, are the same in every case."""
    hidden, weight, labels, mask = _problem(seed=1)
    with torch.no_grad():
        scoring = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, chunk_tokens=5, lse_gemm=True)
    for kept_logits_bytes in (0, 5 * VOCAB * 2, 1 << 20):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        training = vocab_parallel_logprobs(h, w, labels, mask=mask, chunk_tokens=5, with_entropy=True, lse_gemm=True,
                                           kept_logits_bytes=kept_logits_bytes)
        assert torch.equal(training.logprobs, scoring.logprobs), kept_logits_bytes
        without_entropy = vocab_parallel_logprobs(h, w, labels, mask=mask, chunk_tokens=5, lse_gemm=True,
                                                  kept_logits_bytes=kept_logits_bytes)
        assert torch.equal(without_entropy.logprobs, scoring.logprobs), kept_logits_bytes


def test_the_entropy_and_the_gradients_follow_the_stored_logits_as_without_the_kernel(stand_in):
    """The entropy and the backward's log-partition still come from the stored (bf16) logits: the entropy equals the
    two-kernel path's, and the gradients agree with it to the logits' rounding."""
    hidden, weight, labels, mask = _problem(seed=2)
    weights = torch.randn(2, SEQ, BATCH, generator=torch.Generator().manual_seed(9))
    runs = {}
    for lse_gemm in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        result = vocab_parallel_logprobs(h, w, labels, mask=mask, chunk_tokens=5, with_entropy=True, lse_gemm=lse_gemm,
                                         kept_logits_bytes=5 * VOCAB * 2)
        ((weights[0] * result.logprobs).sum() + (weights[1] * result.entropy).sum()).backward()
        runs[lse_gemm] = result, h.grad, w.grad
    (two_kernels, *grads), (with_epilogue, *epilogue_grads) = runs[False], runs[True]
    assert torch.equal(with_epilogue.entropy, two_kernels.entropy)
    for actual, expected in zip(epilogue_grads, grads):
        assert actual.dtype == torch.bfloat16
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=1e-2 * expected.float().abs().max().item())


def test_other_temperatures_keep_the_two_kernel_path(stand_in):
    hidden, weight, labels, mask = _problem(seed=3)
    tempered = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, temperature=0.7, lse_gemm=True)
    assert torch.equal(tempered.logprobs,
                       vocab_parallel_logprobs(hidden, weight, labels, mask=mask, temperature=0.7).logprobs)


def _tensor_parallel_rank(rank, world_size):
    from skyrl_megatron.parallel import init_distributed

    init_distributed("cpu")
    _use_stand_in()
    hidden, weight, labels, mask = _problem(seed=4)
    shard = slice(rank * VOCAB // world_size, (rank + 1) * VOCAB // world_size)
    results = {}
    for with_entropy, kept_logits_bytes in ((False, 0), (True, 0), (True, 1 << 20)):
        local_hidden = hidden.clone().requires_grad_()
        result = vocab_parallel_logprobs(local_hidden, weight[shard].clone(), labels, mask=mask, chunk_tokens=5,
                                         with_entropy=with_entropy, tp_group=dist.group.WORLD, lse_gemm=True,
                                         kept_logits_bytes=kept_logits_bytes)
        results[with_entropy, kept_logits_bytes] = result
    return results


@pytest.mark.slow
def test_vocabulary_shards_combine_their_log_sum_exps_to_world_ones(stand_in):
    """TP2: each shard's log-sum-exp is a (max, sum) pair (lse, 1), combined with the other shard's as the two-kernel
    path combines its own; with and without the stored logits' statistics beside it."""
    hidden, weight, labels, mask = _problem(seed=4)
    world_one = vocab_parallel_logprobs(hidden, weight, labels, mask=mask, chunk_tokens=5, with_entropy=True,
                                        lse_gemm=True)
    for by_case in run_on_ranks(_tensor_parallel_rank, 2, timeout=120):
        for (with_entropy, kept), result in by_case.items():
            torch.testing.assert_close(result.logprobs, world_one.logprobs, rtol=0, atol=1e-5, msg=f"{with_entropy}, {kept}")
            if with_entropy:
                torch.testing.assert_close(result.entropy, world_one.entropy, rtol=0, atol=1e-5)


def test_quack_gets_the_label_columns_and_the_logits_buffer_where_one_is_kept(monkeypatch):
    """`statistics` calls quack's `lse_target_epi` with the weight transposed (a view), the labels this shard owns
    (-1 elsewhere: a column quack never selects, leaving that row of its output unwritten, which becomes 0),
    `tuned=False`, and stores the logits only into a buffer it is given. quack's kernel cannot run on CPU: a module
    standing in for `quack.epilogue.library` records the call and returns garbage in the unwritten rows."""
    calls = []

    def lse_target_epi(a, b, *, out, store_d, target, tuned):
        calls.append((a, b, dict(out), store_d, target.clone(), tuned))
        unwritten = torch.full((a.shape[0],), float("nan"))
        return {"lse": torch.full((a.shape[0],), 7.0), "target_logit": torch.where(target >= 0, 3.0, unwritten), **out}

    library = types.ModuleType("quack.epilogue.library")
    library.lse_target_epi = lse_target_epi
    for name in ("quack", "quack.epilogue"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "quack.epilogue.library", library)
    hidden, weight = torch.zeros(3, 8), torch.zeros(6, 8)
    target, owned = torch.tensor([4, 0, 2]), torch.tensor([True, False, True])
    lse, label_logit = logprob_gemm.statistics(hidden, weight, target, owned)
    buffer = torch.empty(3, 6)
    logprob_gemm.statistics(hidden, weight, target, owned, logits_out=buffer)
    (a, b, out, store_d, columns, tuned), (_, _, kept_out, kept_store_d, _, _) = calls
    assert a is hidden and b.data_ptr() == weight.data_ptr() and b.shape == (8, 6) and tuned is False
    assert columns.tolist() == [4, -1, 2] and out == {} and store_d is False
    assert label_logit.tolist() == [3.0, 0.0, 3.0]
    assert set(kept_out) == {"D"} and kept_out["D"] is buffer and kept_store_d is True
    assert lse.tolist() == [7.0] * 3


def test_the_kernel_takes_only_aligned_half_precision_cuda_operands_at_temperature_one():
    hidden, weight = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not logprob_gemm.takes(hidden, weight, 1.0)  # on the CPU
    on_gpu = hidden.to("meta"), weight.to("meta")
    assert not logprob_gemm.takes(*on_gpu, 1.0)  # a meta tensor is not a CUDA one either


def test_lse_gemm_runs_where_quack_runs_and_the_two_kernel_head_elsewhere(monkeypatch, tmp_path, caplog):
    from skyrl_megatron.model import build
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.runtime import Device, Runtime

    spec = build.ModelSpec(str(tmp_path), fused_kernels=("logprobs", "lse_gemm"))
    assert "lse_gemm" in build.DEFAULT_FUSED_KERNELS
    probed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(quack_support, "missing_reason", lambda device: probed.append(device) or None)
    assert not build._logprobs_in_gemm(spec, Runtime(Device.CPU)) and probed == []  # the CPU runtime: no GPU kernel
    assert build._logprobs_in_gemm(spec, Runtime(Device.CUDA)) and probed == [0]
    assert not build._logprobs_in_gemm(dataclasses.replace(spec, fused_kernels=("logprobs",)), Runtime(Device.CUDA))
    critic = dataclasses.replace(spec, value_head=build.ValueHeadInit(hidden_size=16))
    assert not build._logprobs_in_gemm(critic, Runtime(Device.CUDA))  # a critic's value head has no logprob head
    monkeypatch.setattr(quack_support, "missing_reason", lambda device: "it needs quack-kernels")
    with caplog.at_level("INFO", logger=build.logger.name):
        assert not build._logprobs_in_gemm(spec, Runtime(Device.CUDA))
    assert "logprob head: GEMM, then the statistics kernel (lse_gemm: it needs quack-kernels)" in caplog.text
    build._check_kernels_can_run(spec, Runtime(Device.CUDA))  # nothing refused: the head falls back
