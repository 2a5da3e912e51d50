"""Step 2, plan: which rows form each micro-batch, how many micro-batches every rank runs, and where
each micro-batch's tokens go in the model layout.

Rows go together by a fixed row count, or by a token budget (then packed). Ranks that share expert
or pipeline collectives run the same number of micro-batches (empty ones pad the count; the
interleaved VPP schedule rounds it to a multiple of PP), and where pipeline stages exchange
activations or the allgather MoE dispatcher needs equal token counts, every micro-batch of a
schedule call gets one shape.

The shape follows the packing settings (`PackingSettings`): padded rows, or one packed (THD) row whose
sequences are padded at their ends to a multiple of 2*CP under context parallelism (Megatron's
load-balanced split, `model/layers/context_parallel_layout.py`), the last one further so that every CP
rank's share of the row divides evenly among the TP ranks under sequence parallelism (`packed_lengths`).
All of that arithmetic is done here, from the rows' lengths: each micro-batch leaves the plan as a
`MicroBatchLayout` (its rows, its shape, a packed row's sequence lengths), and the pack step lays the
tokens out as it says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from skyrl_megatron.parallel import ParallelConfig


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def packing_alignment(parallel: ParallelConfig) -> tuple[int, int]:
    """(multiple for each sequence's length, multiple for the packed row's length T)."""
    per_sequence = 2 * parallel.context if parallel.context > 1 else 1
    # under SP each CP rank's T / CP tokens are split again over the TP ranks
    total = per_sequence * (parallel.tensor if parallel.sequence_parallel else 1)
    return per_sequence, total


@dataclass(frozen=True)
class PackingSettings:
    """How rows become model inputs: padded or packed, for the TP/SP/CP sizes that constrain lengths.

    Under context parallelism every sequence is cut into 2 x CP equal chunks, and under sequence
    parallelism each CP rank's share must divide among the TP ranks (see the module docstring).
    """

    packed: bool = False
    tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor=self.tensor, context=self.context, sequence_parallel=self.sequence_parallel)

    @property
    def row_align(self) -> int:
        """Multiple for a padded row's length (and a packed row's total length)."""
        return packing_alignment(self.parallel)[1]


def packed_lengths(seq_lengths: Sequence[int], parallel: ParallelConfig, min_tokens: int = 0) -> list[int]:
    """Each sequence's length in the packed row (alignment padding included; they sum to T)."""
    per_sequence, total = packing_alignment(parallel)
    padded = [round_up(n, per_sequence) for n in seq_lengths]
    padded[-1] += round_up(sum(padded), total) - sum(padded)
    if min_tokens % total:
        raise ValueError(f"min_tokens={min_tokens} is not a multiple of the row alignment {total}")
    padded[-1] += max(0, min_tokens - sum(padded))
    return padded


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are split: by row count, or by a token budget (then packed)."""

    micro_batch_size: int = 1
    max_tokens: int | None = None
    packed: bool = False


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which local rows form each micro-batch (indices into the rank's batch), in order."""

    groups: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.groups)


def plan_micro_batches(
    lengths: torch.Tensor,
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
) -> MicroBatchPlan:
    """Split rows (with `lengths` real tokens each) into micro-batches.

    Without `max_tokens`, every `micro_batch_size` consecutive rows form one. With `max_tokens`,
    rows are packed first-fit-decreasing: longest first, each into the first micro-batch with room
    for it (a row longer than the budget gets one of its own). RL batches have long-tailed lengths;
    taking rows in order leaves many micro-batches part-empty, and fewer, fuller micro-batches mean
    fewer kernel launches and less padding where micro-batches must share a shape. The count found,
    the rows are then spread evenly over it (`_balanced`) where that keeps every micro-batch within
    the budget. Results map back through each micro-batch's row indices, so the order is free.
    """
    n = lengths.numel()
    if max_tokens is None:
        if not micro_batch_size or micro_batch_size < 1:
            raise ValueError("plan_micro_batches needs micro_batch_size >= 1 or max_tokens")
        return MicroBatchPlan([torch.arange(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)])
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    longest_first = sorted(range(n), key=lambda i: (-int(lengths[i]), i))  # ties by index: deterministic
    for i in longest_first:
        length = int(lengths[i])
        slot = next((b for b, free in enumerate(room) if length <= free), None)
        if slot is None:
            bins.append([i])
            room.append(max_tokens - length)
        else:
            bins[slot].append(i)
            room[slot] -= length
    if bins:
        bins = _balanced(lengths, longest_first, len(bins), max_tokens) or bins
    return MicroBatchPlan([torch.tensor(sorted(rows)) for rows in bins])


def _balanced(lengths: torch.Tensor, longest_first: list[int], count: int, max_tokens: int) -> list[list[int]] | None:
    """The rows over `count` micro-batches, longest first into the emptiest (None where one would exceed
    `max_tokens`). First-fit leaves its last micro-batch with the remainder, and a short one is host-bound:
    in a 1.7B scoring pass of 32.7k + 32.6k + 3.8k tokens on an H200 the 3.8k took 48 ms against about 20 ms
    of kernels (every layer's launches); three of 23k keep the GPU busy throughout."""
    bins: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in longest_first:
        emptiest = min(range(count), key=lambda b: (load[b], b))
        bins[emptiest].append(i)
        load[emptiest] += int(lengths[i])
    if any(total > max_tokens and len(rows) > 1 for total, rows in zip(load, bins)):
        return None
    return bins


def pad_plan(plan: MicroBatchPlan, num_micro_batches: int) -> MicroBatchPlan:
    """Append empty micro-batches up to `num_micro_batches` (ranks that share expert or pipeline
    collectives must run the same number of forward passes)."""
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatchPlan(list(plan.groups) + [empty] * (num_micro_batches - len(plan.groups)))


def model_shape(group_lengths: list[list[int]], settings: PackingSettings) -> tuple[int, int]:
    """The smallest model-side shape (rows, columns) that holds every micro-batch, whose rows have
    `group_lengths` real tokens each; computed from the lengths, without building the inputs."""
    groups = [lengths for lengths in group_lengths if lengths]
    if not groups:
        return 1, settings.row_align
    if settings.packed:
        return 1, max(sum(packed_lengths(lengths, settings.parallel)) for lengths in groups)
    widest = max(max(lengths) for lengths in groups)
    return max(len(lengths) for lengths in groups), round_up(max(widest, 1), settings.row_align)


@dataclass(frozen=True)
class MicroBatchLayout:
    """Where one micro-batch's tokens go in the model layout, decided before any tensor is built."""

    rows: torch.Tensor  # indices into the rank's batch (none: a micro-batch that pads the count)
    shape: tuple[int, int]  # (rows, columns) of its model inputs: padded [b', s'], or one packed row [1, T]
    # packed: each sequence's length in the row, alignment padding included (they sum to T); None: padded rows
    packed_lengths: tuple[int, ...] | None = None

    @property
    def packed(self) -> bool:
        return self.packed_lengths is not None


def layout_micro_batch(
    rows: torch.Tensor, lengths: list[int], settings: PackingSettings, shape: tuple[int, int] | None = None
) -> MicroBatchLayout:
    """The layout of micro-batch `rows`, whose rows have `lengths` real tokens each; `shape` is the
    schedule's shared shape (pipeline stages exchange fixed-shape activations), None for its own smallest."""
    if settings.packed:
        min_tokens = shape[1] if shape is not None else 0
        if not lengths:  # an empty micro-batch (padding the count across ranks): one ignored sequence
            total = max(min_tokens, settings.row_align)
            return MicroBatchLayout(rows, (1, total), (total,))
        padded = packed_lengths(lengths, settings.parallel, min_tokens)
        return MicroBatchLayout(rows, (1, sum(padded)), tuple(padded))
    smallest = (len(lengths), round_up(max([*lengths, 1]), settings.row_align))
    if shape is None:
        return MicroBatchLayout(rows, smallest if lengths else (1, settings.row_align))  # empty: one pad row
    if shape[0] < smallest[0] or shape[1] < smallest[1]:
        raise ValueError(f"the schedule's shape {shape} is smaller than the micro-batch {smallest}")
    return MicroBatchLayout(rows, shape)


@dataclass(frozen=True)
class SchedulePlan:
    """The micro-batches of one schedule call on this rank (empty ones pad the count) and the shape the
    schedule is told (every micro-batch's where they share one)."""

    micro_batches: list[MicroBatchLayout]
    shape: tuple[int, int]  # (rows, columns)


def plan_schedule(
    lengths: torch.Tensor,
    batching: MicroBatching,
    parallel: ParallelConfig,
    *,
    equal_token_counts: bool,
    device: torch.device,
) -> SchedulePlan:
    """Plan this rank's micro-batches for rows with `lengths` real tokens (collective: every rank of
    the world agrees on the count, and with `equal_token_counts` on the shape)."""
    packed = batching.packed or batching.max_tokens is not None
    plan = plan_micro_batches(lengths, micro_batch_size=batching.micro_batch_size, max_tokens=batching.max_tokens)
    settings = PackingSettings(
        packed=packed, tensor=parallel.tensor, sequence_parallel=parallel.sequence_parallel, context=parallel.context
    )
    group_lengths = [lengths[rows].tolist() for rows in plan.groups]
    shape = model_shape(group_lengths, settings)
    if not packed:
        shape = (max(shape[0], batching.micro_batch_size), shape[1])
    # Pipeline stages exchange fixed-shape activations, and the allgather MoE dispatcher needs as
    # many tokens on every expert-parallel rank: only there do micro-batches share one shape.
    # Elsewhere each keeps its own, so no compute goes to padding up to the largest one (on
    # long-tailed RL batches that was 18% of the positions at a 16k-token budget).
    fixed_shape = parallel.pipeline > 1 or equal_token_counts
    # every rank runs the same number of micro-batches: expert-parallel all-to-alls and the
    # pipeline pair up forward passes across data-parallel ranks; the allgather MoE dispatcher
    # also needs as many tokens on every expert-parallel rank, hence one shape for all ranks
    agreed = [len(plan), *(shape if equal_token_counts else ())]
    if dist.get_world_size() > 1:  # alone, there is nothing to agree on (and no device round trip to wait for)
        agreed = torch.tensor(agreed, dtype=torch.long, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        agreed = agreed.tolist()
    count = agreed[0]
    if equal_token_counts:
        shape = (agreed[1], agreed[2])
    if parallel.virtual_pipeline:
        # the interleaved schedule walks micro-batches in groups of PP size
        count = -(-count // parallel.pipeline) * parallel.pipeline
    groups = pad_plan(plan, count).groups
    group_lengths += [[]] * (count - len(plan))
    shared = shape if fixed_shape else None
    layouts = [layout_micro_batch(rows, n, settings, shared) for rows, n in zip(groups, group_lengths)]
    return SchedulePlan(layouts, shape)
