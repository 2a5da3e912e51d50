"""AdamW straight on compact master weights: one run's step without writing its fp32 masters.

A run of compact masters (`master_weights`: back-to-back bf16 model shards of Megatron's parameter buffer, each
master stored as its weight and an int16 remainder) is stepped today by joining the masters into fp32, running
torch's fused AdamW over them and splitting them again. `step_compact_run` does the same update without the fp32
masters: on GPUs one Triton pass per run (`compact_adam_kernels`, 28 bytes a parameter against 44-48), on CPU the
eager chain of join, `adam_step_reference` and split, which is also the pass's definition: the two agree bit for bit.

The update is AdamW's, in the order PyTorch's fused kernel takes it (decay, moments, bias-corrected step), in fp32
with the per-group scalars rounded to fp32 once (`AdamScalars`); each tensor of a run has its parameter group's
scalars, the padding between tensors is left alone. A non-finite gradient norm's skip and the clip's gradient
divisor are read on the device, as torch's fused Adam reads `found_inf` and `grad_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skyrl_megatron import master_weights


@dataclass(frozen=True)
class AdamScalars:
    """One parameter group's AdamW settings at one step (`step` counts from 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def row(self) -> list[float]:
        """The scalars the update reads, computed in double: [lr * weight decay, beta1, 1 - beta1, beta2, 1 - beta2,
        lr / (1 - beta1**step), sqrt(1 - beta2**step), eps]."""
        if self.step < 1:
            raise ValueError(f"AdamScalars.step counts from 1, got {self.step}")
        return [self.lr * self.weight_decay, self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2,
                self.lr / (1.0 - self.beta1**self.step), math.sqrt(1.0 - self.beta2**self.step), self.eps]


def scalar_table(groups: Sequence[AdamScalars], device: torch.device) -> Tensor:
    """fp32 [groups, 8]: each group's `AdamScalars.row`, rounded to fp32 once."""
    return torch.tensor([g.row() for g in groups], dtype=torch.float32).to(device)


Span = tuple[int, int, int]  # [start, stop) of one tensor in its run's span, and its parameter group's row


def adam_step_reference(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, spans: Sequence[Span],
                        hyper: Tensor, skip: Tensor, scale: Tensor | None) -> None:
    """AdamW over the `spans` of flat fp32 `master`, `exp_avg` and `exp_avg_sq` (in place), `grad` read; the
    definition the Triton pass follows operation for operation (IEEE division and square root, no fused
    multiply-adds). `skip`: a 0-d tensor, nonzero leaves every value as it was; `scale`: the gradient's divisor."""
    keep = skip != 0
    for start, stop, group in spans:
        row = hyper[group]
        param, avg, avg_sq = master[start:stop], exp_avg[start:stop], exp_avg_sq[start:stop]
        g = grad[start:stop] if scale is None else grad[start:stop] / scale
        decayed = param - row[0] * param
        new_avg = row[1] * avg + row[2] * g
        new_avg_sq = row[3] * avg_sq + row[4] * g * g
        denom = _sqrt_rn(new_avg_sq) / row[6] + row[7]
        updated = decayed - row[5] * new_avg / denom
        param.copy_(torch.where(keep, param, updated))
        avg.copy_(torch.where(keep, avg, new_avg))
        avg_sq.copy_(torch.where(keep, avg_sq, new_avg_sq))


def _sqrt_rn(values: Tensor) -> Tensor:
    """fp32 square roots rounded to nearest (through fp64, exact for fp32 inputs): PyTorch's vectorized CPU sqrt
    is not always (640 of 100k uniform values one ulp off on an AVX-512 machine)."""
    return values.double().sqrt().float()


class CompactAdamError(RuntimeError):
    """A step left a master that its weight and an int16 remainder cannot hold (a NaN from the update)."""


@dataclass(frozen=True)
class RunLayout:
    """A run's tensors ([start, stop) and parameter group each) and, on GPUs, the pass's block table over them:
    built once per run (`run_layout`), the spans do not change between steps."""

    spans: tuple[Span, ...]
    blocks: tuple[Tensor, Tensor, Tensor] | None


def run_layout(spans: Sequence[Span], device: torch.device) -> RunLayout:
    if device.type != "cuda":
        return RunLayout(tuple(spans), None)
    from skyrl_megatron import compact_adam_kernels as kernels

    return RunLayout(tuple(spans), kernels.block_table(spans, device))


@dataclass
class QueuedStep:
    """A run's step queued on the device; `settle` reads its checks (with other runs') and finds its ties."""

    remainder: Tensor
    stats: Tensor  # int64 [worst status, new ties], on the device
    found: object  # what `compact_adam_kernels.tie_indices` needs; on CPU the tie indices themselves (None: NaN)


def queue_run_step(model: Tensor, remainder: Tensor, ties: Tensor, grad: Tensor, exp_avg: Tensor,
                   exp_avg_sq: Tensor, layout: RunLayout, hyper: Tensor, skip: Tensor,
                   scale: Tensor | None = None) -> QueuedStep:
    """One AdamW step of a run held as `model` (flat bf16 over the run's span), `remainder` and the indices of its
    ties rounded down, queued without a host read: `model`, `remainder` (on GPUs), `exp_avg` and `exp_avg_sq` (flat
    fp32 over the span) change in place, `grad` (flat fp32 over the span) is read; `settle` gives the new remainder
    and ties."""
    if layout.blocks is not None:
        from skyrl_megatron import compact_adam_kernels as kernels

        upper = model.view(torch.int16)
        if ties.numel():  # the weight one up over -2**15 is the listed tie's master: the pass needs no list
            upper[ties] += 1
        return QueuedStep(*kernels.adam_round_split(upper, remainder, grad, exp_avg, exp_avg_sq, *layout.blocks,
                                                    hyper, skip, scale))
    master = master_weights.join_master(model, remainder, ties)
    adam_step_reference(master, grad, exp_avg, exp_avg_sq, layout.spans, hyper, skip, scale)
    split = master_weights.split_master(master, model, write_model=True)
    if split is None:
        return QueuedStep(remainder, torch.tensor([master_weights.OUT_OF_RANGE, 0]), None)
    return QueuedStep(split[0], torch.tensor([0, split[1].numel()]), split[1])


def settle(queued: Sequence[QueuedStep]) -> list[tuple[Tensor, Tensor]]:
    """(remainder, tie indices) of each queued step, after one host read of all their checks."""
    if not queued:
        return []
    checks = torch.cat([step.stats for step in queued]).tolist()
    results = []
    for step, worst, count in zip(queued, checks[0::2], checks[1::2]):
        if worst >= master_weights.OUT_OF_RANGE:
            raise CompactAdamError(_NAN_MESSAGE)
        if isinstance(step.found, Tensor):  # found on CPU already
            results.append((step.remainder, step.found))
        else:
            from skyrl_megatron import compact_adam_kernels as kernels

            results.append((step.remainder, kernels.tie_indices(step.found, count)))
    return results


def step_compact_run(model: Tensor, remainder: Tensor, ties: Tensor, grad: Tensor, exp_avg: Tensor,
                     exp_avg_sq: Tensor, spans: Sequence[Span], hyper: Tensor, skip: Tensor,
                     scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`queue_run_step` and `settle` of one run: its new (remainder, tie indices)."""
    layout = run_layout(spans, model.device)
    return settle([queue_run_step(model, remainder, ties, grad, exp_avg, exp_avg_sq, layout, hyper, skip, scale)])[0]


_NAN_MESSAGE = ("compact master weights: the optimizer step produced a master that is NaN (finite gradients, "
                "moments and settings do not): check optimizer_config.lr and the betas")
