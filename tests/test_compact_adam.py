"""AdamW straight on compact master weights (`compact_adam.py`, `compact_adam_kernels.py`).

The eager step (join, `adam_step_reference`, split) must leave the same masters, bit for bit, as the same update on
fp32 masters never compacted, step after step, ties rounded down included; the reference must be torch's AdamW to
within rounding; the GPU's one-pass Triton kernel runs under Triton's interpreter and must equal the eager step bit
for bit (weights, remainders, ties, moments), with the clip's divisor, a skipped step and ties found by its bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_megatron import compact_adam, master_weights
from skyrl_megatron.compact_adam import AdamScalars, CompactAdamError, scalar_table, step_compact_run

_BLOCK = 4096  # compact_adam_kernels.BLOCK (not imported here: the module imports Triton)


def _run_of(sizes: list[int], seed: int = 0, ties: int = 40):
    """A run as Megatron's buffer lays it out: tensors of `sizes` at 64-element starts (zero padding between),
    alternately in parameter groups 0 and 1, masters with `ties` ties rounded down planted; returns (spans,
    fp32 masters over the span, gradient, exp_avg, exp_avg_sq)."""
    generator = torch.Generator().manual_seed(seed)
    spans, start = [], 0
    for index, size in enumerate(sizes):
        spans.append((start, start + size, index % 2))
        start += -(-size // 64) * 64
    masters = torch.randn(start, generator=generator) * 0.05
    bits = masters.view(torch.int32)
    planted = torch.randint(0, start, (ties,), generator=generator)
    bits[planted] = (bits[planted] & ~0x1FFFF) | 0x8000  # the lower half exactly half, over an even weight
    padding = torch.ones(start, dtype=torch.bool)
    for first, stop, _ in spans:
        padding[first:stop] = False
    masters[padding] = 0.0
    grad = torch.randn(start, generator=generator) * 1e-2
    grad[padding] = 0.0
    exp_avg = torch.randn(start, generator=generator) * 1e-3
    exp_avg_sq = torch.rand(start, generator=generator) * 1e-5
    return spans, masters, grad, exp_avg, exp_avg_sq


def _group_at(spans, start: int) -> int:
    return next(group for first, _, group in spans if first == start)


def _scalars(step: int, lr: float = 1e-3) -> list[AdamScalars]:
    return [AdamScalars(lr, 0.9, 0.95, 1e-8, 0.1, step), AdamScalars(lr / 5, 0.9, 0.999, 1e-8, 0.0, step)]


def test_compact_steps_leave_the_masters_fp32_training_leaves_bitwise():
    """Four steps (the third clipped, the fourth skipped) of a compact run against the same update of fp32 masters
    that are never compacted: every master, weight and moment equal bit for bit, ties rounded down included."""
    spans, masters, grad, exp_avg, exp_avg_sq = _run_of([1, 70, 4095, 4097, 9000, 500])
    model = masters.to(torch.bfloat16)
    remainder, ties = master_weights.split_master(masters, model)
    assert ties.numel() > 30  # the planted ties survive the split as ties
    fp32 = masters.clone(), exp_avg.clone(), exp_avg_sq.clone()
    seen_ties = []
    for step, (skip, scale) in enumerate([(0.0, None), (0.0, None), (0.0, 2.5), (1.0, None)], start=1):
        hyper = scalar_table(_scalars(min(step, 3)), torch.device("cpu"))
        skip, scale = torch.tensor(skip), None if scale is None else torch.tensor(scale)
        step_grad = grad * step
        remainder, ties = step_compact_run(model, remainder, ties, step_grad, exp_avg, exp_avg_sq, spans, hyper,
                                           skip, scale)
        compact_adam.adam_step_reference(fp32[0], step_grad, fp32[1], fp32[2], spans, hyper, skip, scale)
        joined = master_weights.join_master(model, remainder, ties)
        assert torch.equal(joined.view(torch.int32), fp32[0].view(torch.int32)), step
        assert torch.equal(model, fp32[0].to(torch.bfloat16)), step
        assert torch.equal(exp_avg, fp32[1]) and torch.equal(exp_avg_sq, fp32[2]), step
        seen_ties.append(ties.numel())
    assert not torch.equal(fp32[0], masters)  # it moved
    assert seen_ties[-1] == seen_ties[-2]  # the skipped step kept everything, its ties too


def test_the_reference_is_torchs_adamw_to_within_rounding():
    """Three steps of `adam_step_reference` against torch's AdamW (two groups, decay on one, a clipped step): the
    masters and moments within a few fp32 ulps, where a wrong bias correction or decay is off by far more."""
    spans, masters, grad, exp_avg, exp_avg_sq = _run_of([300, 1000, 64, 2000], ties=0)
    ours = masters.clone(), torch.zeros_like(masters), torch.zeros_like(masters)
    params = [torch.nn.Parameter(masters[a:b].clone()) for a, b, _ in spans]
    groups = [{"params": [p for p, (_, _, g) in zip(params, spans) if g == group], "lr": s.lr,
               "betas": (s.beta1, s.beta2), "eps": s.eps, "weight_decay": s.weight_decay}
              for group, s in enumerate(_scalars(1))]
    adam = torch.optim.AdamW(groups)
    for step, scale in enumerate([None, None, 3.0], start=1):
        step_grad = grad * (1 + step)
        for p, (a, b, _) in zip(params, spans):
            p.grad = step_grad[a:b] / (1.0 if scale is None else scale)
        adam.step()
        compact_adam.adam_step_reference(ours[0], step_grad, ours[1], ours[2], spans,
                                          scalar_table(_scalars(step), torch.device("cpu")), torch.tensor(0.0),
                                          None if scale is None else torch.tensor(scale))
    for p, (a, b, _) in zip(params, spans):
        # the masters within 1e-4 of a step's size (a wrong decay or bias correction moves them by 1e-2 of it
        # or more), the moments within a few ulps (torch takes them through lerp and addcmul)
        assert (ours[0][a:b] - p.detach()).abs().max() <= 1e-4 * groups[_group_at(spans, a)]["lr"], (a, b)
        for mine, theirs in ((ours[1][a:b], adam.state[p]["exp_avg"]), (ours[2][a:b], adam.state[p]["exp_avg_sq"])):
            assert (mine.view(torch.int32).long() - theirs.view(torch.int32).long()).abs().max() <= 4, (a, b)
    assert not torch.equal(ours[0], masters)


def test_a_step_that_makes_a_nan_master_is_refused_by_name():
    spans, masters, grad, exp_avg, exp_avg_sq = _run_of([100], ties=0)
    model = masters.to(torch.bfloat16)
    remainder, ties = master_weights.split_master(masters, model)
    hyper = scalar_table([AdamScalars(float("nan"), 0.9, 0.95, 1e-8, 0.0, 1)] * 2, torch.device("cpu"))
    with pytest.raises(CompactAdamError, match="optimizer_config.lr"):
        step_compact_run(model, remainder, ties, grad, exp_avg, exp_avg_sq, spans, hyper, torch.tensor(0.0))


def test_scalars_count_steps_from_one():
    with pytest.raises(ValueError, match="counts from 1"):
        AdamScalars(1e-3, 0.9, 0.95, 1e-8, 0.0, 0).row()


_TRITON_CHECK = """
import sys
import torch
sys.path.insert(0, TESTS)
from test_compact_adam import _run_of, _scalars
from skyrl_megatron import compact_adam, master_weights
from skyrl_megatron import compact_adam_kernels as kernels
from skyrl_megatron.compact_adam import AdamScalars, scalar_table

B = kernels.BLOCK
assert B == BLOCK
cases = 0
# lengths around a block's, and the same with every start and length a multiple of 8 (16-byte accesses)
for sizes, aligned in (([1, 70, B - 1, B, B + 3, 2 * B + 17, 500], False),
                       ([8, 64, B - 8, B, B + 8, 2 * B + 16, 504], True)):
    spans, masters, grad, exp_avg, exp_avg_sq = _run_of(sizes)
    # a tensor whose update is nothing (no gradient, no moments, no decay): its ties come back through the kernel's bits
    still = spans[5]  # in group 1, without decay
    grad[still[0]:still[1]] = 0.0
    exp_avg[still[0]:still[1]] = 0.0
    exp_avg_sq[still[0]:still[1]] = 0.0
    # ties at all sixteen bit positions of one word of tie bits (the word's top bit is its int16's sign)
    word = masters.view(torch.int32)[still[0] + 48:still[0] + 64]
    word.copy_((word & ~0x1FFFF) | 0x8000)
    model = masters.to(torch.bfloat16)
    remainder, ties = master_weights.split_master(masters, model)
    planted_in_still = int(((ties >= still[0]) & (ties < still[1])).sum())
    assert planted_in_still >= 16 + 2, planted_in_still
    table = kernels.block_table(spans, torch.device("cpu"))
    assert table.aligned == aligned
    assert torch.equal(table.starts, torch.sort(table.starts).values) and int(table.counts.max()) <= B
    assert int(table.counts.sum()) == sum(b - a for a, b, _ in spans)

    def step(on_kernel, skip, scale):
        state = [model.clone(), remainder.clone(), ties.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        hyper = scalar_table(_scalars(2), torch.device("cpu"))
        layout = compact_adam.RunLayout(tuple(spans), table if on_kernel else None)  # with blocks: the GPU's branch
        queued = compact_adam.queue_run_step(state[0], state[1], state[2], grad, state[3], state[4], layout, hyper,
                                             skip, scale)
        (new_remainder, new_ties), = compact_adam.settle([queued])
        return state[0].view(torch.int16), new_remainder, new_ties, state[3], state[4]

    for skip in (0.0, 1.0):
        for scale in (None, 1.7):
            skip_t, scale_t = torch.tensor(skip), None if scale is None else torch.tensor(scale)
            eager, kernel = step(False, skip_t, scale_t), step(True, skip_t, scale_t)
            for name, want, got in zip(["weights", "remainders", "ties", "exp_avg", "exp_avg_sq"], eager, kernel):
                assert torch.equal(want, got), (name, skip, scale, aligned)
            if skip:
                assert torch.equal(eager[0], model.view(torch.int16)) and torch.equal(eager[2], ties)
            else:
                assert not torch.equal(eager[0], model.view(torch.int16))
                assert int(((eager[2] >= still[0]) & (eager[2] < still[1])).sum()) == planted_in_still
            cases += 1
# a NaN master from the update: refused on the kernel's path as on the eager one
hyper = scalar_table([AdamScalars(float("nan"), 0.9, 0.95, 1e-8, 0.0, 1)] * 2, torch.device("cpu"))
upper = model.clone().view(torch.int16)
_, stats, _ = kernels.adam_round_split(upper, remainder.clone(), grad, exp_avg.clone(), exp_avg_sq.clone(), table,
                                       hyper, torch.tensor(0.0), None)
assert int(stats[0]) == master_weights.OUT_OF_RANGE
print(cases + 1)
"""


def test_the_triton_pass_steps_as_the_eager_chain_does_bitwise():
    """The GPU's one pass (`compact_adam_kernels`) under Triton's interpreter against the eager step at lengths
    around a block's (padding between the tensors, two parameter groups), and at lengths and starts that allow
    16-byte accesses: weights, remainders, tie indices and
    both moments equal, with and without the clip's divisor, a skipped step leaving everything as it was, the
    ties of a tensor the update leaves alone found again through the pass's tie bits, and a NaN master reported
    out of range."""
    from skyrl_megatron.testing import last_word_under_triton_interpreter

    script = f"TESTS = {str(Path(__file__).parent)!r}\nBLOCK = {_BLOCK}\n" + _TRITON_CHECK
    assert last_word_under_triton_interpreter(script, timeout=300) == "9"
