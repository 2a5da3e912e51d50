"""Memory planner: per-GPU training memory of a model under a Megatron layout, and layouts that fit.

Pure Python (no torch, no Megatron), so it answers in milliseconds and runs anywhere:

    from skyrl_megatron.planner import BatchPlan, Layout, estimate, load_model_arch

    arch = load_model_arch("examples/megatron/model_configs/Qwen3-30B-A3B.json")
    result = estimate(arch, Layout(nodes=1, gpus_per_node=8, ep=8), BatchPlan(8192, recompute="full"))
    print(result.total / 2**30, "GiB on stage", result.stage)

`skyrl-megatron plan` is the command-line front end (`planner/cli.py`); the formulas are in
`planner/memory.py`.
"""

from skyrl_megatron.planner.arch import SUPPORTED_MODEL_TYPES, LayerParams, ModelArch, load_model_arch
from skyrl_megatron.planner.errors import PlanError
from skyrl_megatron.planner.layout import Layout, candidate_layouts, check_layout, layout_problems
from skyrl_megatron.planner.memory import (
    BatchPlan,
    MemoryEstimate,
    StageParameters,
    TrainingSetup,
    estimate,
    layer_activation_bytes,
    stage_parameters,
)
from skyrl_megatron.planner.suggest import Suggestion, suggest_layouts

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "BatchPlan",
    "LayerParams",
    "Layout",
    "MemoryEstimate",
    "ModelArch",
    "PlanError",
    "StageParameters",
    "Suggestion",
    "TrainingSetup",
    "candidate_layouts",
    "check_layout",
    "estimate",
    "layer_activation_bytes",
    "layout_problems",
    "load_model_arch",
    "stage_parameters",
    "suggest_layouts",
]
