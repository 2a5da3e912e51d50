"""Layouts of a cluster that fit a GPU, most data-parallel first.

Ranking: fewest GPUs per copy of the dense weights (TP x PP x CP; more data parallelism means less
communication per token), then the fewest pipeline stages (bubbles), the least context parallelism,
expert TP 1 before expert TP = TP, the smallest EP (fewest all-to-all peers) and the smallest
footprint. Interleaving (VPP) is never suggested: add it yourself to shrink the pipeline bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_megatron.planner.arch import ModelArch
from skyrl_megatron.planner.layout import Layout, candidate_layouts
from skyrl_megatron.planner.memory import BatchPlan, MemoryEstimate, TrainingSetup, estimate


@dataclass(frozen=True)
class Suggestion:
    layout: Layout
    estimate: MemoryEstimate


def suggest_layouts(
    arch: ModelArch,
    nodes: int,
    gpus_per_node: int,
    batch: BatchPlan,
    gpu_memory_bytes: float,
    training: TrainingSetup = TrainingSetup(),
    *,
    sequence_parallel: bool = True,
) -> list[Suggestion]:
    """Every valid layout whose estimate fits `gpu_memory_bytes`, best first."""
    fitting = []
    for layout in candidate_layouts(arch, nodes, gpus_per_node, sequence_parallel=sequence_parallel):
        result = estimate(arch, layout, batch, training)
        if result.fits(gpu_memory_bytes):
            fitting.append(Suggestion(layout, result))
    return sorted(fitting, key=_rank)


def _rank(suggestion: Suggestion) -> tuple:
    layout = suggestion.layout
    return (layout.model_parallel_size, layout.pp, layout.cp, layout.expert_tp, layout.ep, suggestion.estimate.total)
