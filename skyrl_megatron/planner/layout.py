"""Megatron parallel layouts: the sizes, the groups they imply, and which ones a model allows.

Megatron splits the world twice. Attention and dense layers use TP x CP x DP x PP; expert layers use
ETP x EP x expert-DP x PP over the same ranks. The distributed optimizer shards dense state over
DP x CP and expert state over expert-DP.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from skyrl_megatron.planner.arch import ModelArch
from skyrl_megatron.planner.errors import PlanError


@dataclass(frozen=True)
class Layout:
    """A cluster and Megatron's parallel sizes on it; DP and expert-DP follow from the world size."""

    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved schedule)
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: same as tp (Megatron's default)
    sequence_parallel: bool = True  # effective only when tp > 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.pp * self.expert_tp * self.ep)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def model_parallel_size(self) -> int:
        """GPUs that hold one copy of the dense weights between them."""
        return self.tp * self.pp * self.cp


def layout_problems(arch: ModelArch, layout: Layout) -> list[PlanError]:
    """Everything that keeps `layout` from running `arch`, each naming the flag and the fix."""
    sizes = {
        "--nodes": layout.nodes,
        "--gpus-per-node": layout.gpus_per_node,
        "--tp": layout.tp,
        "--pp": layout.pp,
        "--vpp": layout.chunks,
        "--cp": layout.cp,
        "--ep": layout.ep,
        "--etp": layout.expert_tp,
    }
    not_positive = [flag for flag, value in sizes.items() if value < 1]
    if not_positive:
        return [PlanError(flag, f"must be a positive integer, got {sizes[flag]}", "set it to 1 or more") for flag in not_positive]

    problems: list[PlanError] = []

    def problem(flag: str, message: str, fix: str) -> None:
        problems.append(PlanError(flag, message, fix))

    world, tp = layout.world_size, layout.tp
    if world % layout.model_parallel_size:
        problem(
            "--tp/--pp/--cp",
            f"the world size {world} (--nodes x --gpus-per-node) is not divisible by TP*PP*CP = {layout.model_parallel_size}",
            f"choose sizes whose product divides {world}",
        )
    # Megatron-Bridge does not pad the vocabulary, so the vocab-parallel embedding needs TP | vocab.
    tp_split = (
        ("number of attention heads", arch.num_attention_heads),
        ("number of key/value heads", arch.num_kv_heads),
        ("dense MLP width", arch.ffn_hidden_size),
        ("vocabulary size", arch.vocab_size),
    )
    for what, count in tp_split:
        if count % tp:
            problem("--tp", f"the model's {what} ({count}) is not divisible by TP={tp}", f"choose a --tp that divides {count}")
    stages = layout.pp * layout.chunks
    if arch.num_layers % stages:
        problem(
            "--pp/--vpp",
            f"the model's {arch.num_layers} layers do not split evenly into PP*VPP = {stages} model chunks",
            f"choose --pp and --vpp whose product divides {arch.num_layers}",
        )
    if layout.chunks > 1 and layout.pp == 1:
        problem("--vpp", "interleaved stages need pipeline parallelism", "set --pp 2 or more, or drop --vpp")

    if not arch.is_moe:
        if layout.ep > 1 or layout.etp is not None:
            problem("--ep/--etp", f"{arch.name} ({arch.model_type}) is a dense model", "drop --ep and --etp")
        return problems
    if arch.num_experts % layout.ep:
        problem(
            "--ep",
            f"the model's number of experts ({arch.num_experts}) is not divisible by EP={layout.ep}",
            f"choose an --ep that divides {arch.num_experts}",
        )
    if arch.moe_ffn_hidden_size % layout.expert_tp:
        problem(
            "--etp",
            f"the experts' width ({arch.moe_ffn_hidden_size}) is not divisible by ETP={layout.expert_tp}",
            "choose a smaller --etp (1 is usual)",
        )
    expert_group = layout.pp * layout.expert_tp * layout.ep
    if world % expert_group:
        problem(
            "--ep/--etp",
            f"the world size {world} is not divisible by PP*ETP*EP = {expert_group}",
            "choose --ep (and --etp) so that PP*ETP*EP divides the world size",
        )
    if tp > 1 and layout.ep > 1 and not layout.sequence_parallel:
        problem(
            "--no-sequence-parallel",
            "Megatron's MoE layers need sequence parallelism when TP > 1 and EP > 1",
            "drop --no-sequence-parallel",
        )
    return problems


def check_layout(arch: ModelArch, layout: Layout) -> None:
    """Raise the first problem of `layout` for `arch`, if any."""
    problems = layout_problems(arch, layout)
    if problems:
        raise problems[0]


def candidate_layouts(
    arch: ModelArch, nodes: int, gpus_per_node: int, *, sequence_parallel: bool = True
) -> Iterator[Layout]:
    """Every valid layout of `nodes` x `gpus_per_node` for `arch`, without interleaving (VPP).

    TP and CP stay inside a node: both communicate inside every layer, on the critical path.
    ETP is 1 or TP, the two settings Megatron's MoE recipes use.
    """
    world = nodes * gpus_per_node
    for tp in _divisors(gpus_per_node):
        for cp in _divisors(gpus_per_node // tp):
            for pp in _divisors(arch.num_layers):
                if world % (tp * cp * pp):
                    continue
                expert_options = [(1, None)]
                if arch.is_moe:
                    expert_options = [(ep, etp) for ep in _divisors(arch.num_experts) for etp in sorted({1, tp})]
                for ep, etp in expert_options:
                    layout = Layout(
                        nodes, gpus_per_node, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, sequence_parallel=sequence_parallel
                    )
                    if not layout_problems(arch, layout):
                        yield layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
