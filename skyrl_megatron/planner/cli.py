"""`skyrl-megatron plan`: per-GPU memory of a layout, or the layouts that fit a GPU.

    skyrl-megatron plan --model Qwen3-30B-A3B/config.json --nodes 1 --gpus-per-node 8 \
        --ep 8 --micro-batch-tokens 8192 --recompute full --gpu-memory-gib 141
    skyrl-megatron plan --model Qwen3-30B-A3B/config.json --nodes 4 --suggest --gpu-memory-gib 80

Bad input exits with status 2 and one line naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from skyrl_megatron.planner.arch import load_model_arch
from skyrl_megatron.planner.errors import PlanError
from skyrl_megatron.planner.layout import Layout
from skyrl_megatron.planner.memory import (
    DEFAULT_LOGITS_CHUNK_BYTES, DEFAULT_LOGITS_KEPT_BYTES, GIB, RECOMPUTE_GRANULARITIES, BatchPlan, MemoryEstimate, TrainingSetup, estimate,
)
from skyrl_megatron.planner.report import format_estimate, format_suggestions
from skyrl_megatron.planner.suggest import suggest_layouts

PROG = "skyrl-megatron plan"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Estimate per-GPU training memory for a model, a Megatron layout and a micro-batch, "
        "or (--suggest) list the layouts that fit a GPU.",
    )
    parser.add_argument("--model", required=True, help="an HF config.json, or a checkpoint directory holding one")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, default=1)
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default: 80)")
    layout = parser.add_argument_group("layout (ignored with --suggest)")
    layout.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    layout.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    layout.add_argument("--cp", type=int, default=1, help="context parallel size")
    layout.add_argument("--ep", type=int, default=1, help="expert parallel size")
    layout.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    layout.add_argument("--no-sequence-parallel", action="store_true", help="turn Megatron sequence parallelism off")
    training = parser.add_argument_group("training")
    training.add_argument(
        "--micro-batch-tokens", type=int, default=8192, help="packed tokens per micro-batch (max_tokens_per_microbatch)"
    )
    training.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES, default="none", help="activation recompute granularity")
    training.add_argument(
        "--recompute-modules", default="core_attn", help="with --recompute selective: comma-separated Megatron recompute_modules"
    )
    training.add_argument(
        "--unfused-swiglu",
        action="store_true",
        help="eager SwiGLU (swiglu not in megatron_config.fused_kernels, or bias_activation_fusion=false)",
    )
    training.add_argument(
        "--swiglu-gemm-training",
        action="store_true",
        help="swiglu_gemm_training in megatron_config.fused_kernels: the dense MLP keeps fc1's output only",
    )
    training.add_argument(
        "--unfused-logprobs",
        action="store_true",
        help="the logprob head's eager chain (logprobs not in megatron_config.fused_kernels): fp32 copies of each chunk",
    )
    training.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_true",
        help="transformer_config_kwargs.gradient_accumulation_fusion=false: the logprob head's output weight "
             "gradient accumulates in an fp32 buffer of its own instead of main_grad",
    )
    training.add_argument(
        "--logits-chunk-mib", type=int, default=DEFAULT_LOGITS_CHUNK_BYTES // 2**20, help="the logprob head's fp32 logits per chunk (logits_chunk_mib)"
    )
    training.add_argument(
        "--logits-kept-mib", type=int, default=DEFAULT_LOGITS_KEPT_BYTES // 2**20,
        help="the logits a training forward keeps for its backward (logits_kept_mib)",
    )
    training.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    training.add_argument(
        "--optimizer-offload-fraction", type=float, default=0.0, help="share of the optimizer state on the CPU"
    )
    training.add_argument("--no-grad-reduce-in-fp32", action="store_true", help="bf16 gradient buffers")
    training.add_argument("--no-distributed-optimizer", action="store_true", help="do not shard optimizer state over DP")
    training.add_argument("--compact-master-weights", nargs="?", type=_true_false_auto, const=True, default="auto",
                          metavar="{auto,true,false}",
                          help="fp32 masters kept as bf16 weight + 16-bit remainder between steps (compact_master_weights; "
                               "auto, the default: with the distributed optimizer and nothing offloaded)")
    training.add_argument("--compact-adam", nargs="?", type=_true_false_auto, const=True, default="auto",
                          metavar="{auto,true,false}",
                          help="AdamW straight on the compact masters, no fp32 rebuild in the step (compact_adam; auto, "
                               "the default: with compact master weights and fp32 gradient buffers)")
    parser.add_argument("--suggest", action="store_true", help="list the layouts of the cluster that fit --gpu-memory-gib")
    parser.add_argument("--top", type=int, default=10, help="with --suggest: how many layouts to print")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        print(_run(args))
    except PlanError as err:
        parser.error(str(err))  # exits 2
    return 0


def _run(args: argparse.Namespace) -> str:
    if args.gpu_memory_gib <= 0:
        raise PlanError("--gpu-memory-gib", f"must be positive, got {args.gpu_memory_gib:g}", "give one GPU's memory, e.g. 80")
    arch = load_model_arch(args.model)
    batch, training = _batch_plan(args), _training_setup(args)
    gpu_memory = args.gpu_memory_gib * GIB
    if args.suggest:
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise PlanError("--nodes/--gpus-per-node", "must be positive", "give the cluster's size")
        suggestions = suggest_layouts(
            arch, args.nodes, args.gpus_per_node, batch, gpu_memory, training, sequence_parallel=not args.no_sequence_parallel
        )
        return format_suggestions(arch, args.nodes, args.gpus_per_node, batch, training, suggestions, gpu_memory, args.top)
    layout = _layout(args)
    result = estimate(arch, layout, batch, training)
    return format_estimate(arch, layout, batch, training, result, gpu_memory)


def _batch_plan(args: argparse.Namespace) -> BatchPlan:
    return BatchPlan(
        micro_batch_tokens=args.micro_batch_tokens,
        recompute=args.recompute,
        recompute_modules=tuple(m.strip() for m in args.recompute_modules.split(",") if m.strip()),
        swiglu_fusion=not args.unfused_swiglu,
        swiglu_gemm_training=args.swiglu_gemm_training,
        logprobs_fusion=not args.unfused_logprobs,
        logits_chunk_bytes=args.logits_chunk_mib * 2**20,
        logits_kept_bytes=args.logits_kept_mib * 2**20,
    )


def _true_false_auto(text: str) -> bool | str:
    """A megatron_config value that may be true, false or auto, as the config spells it."""
    value = {"true": True, "false": False, "auto": "auto"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")
    return value


def _training_setup(args: argparse.Namespace) -> TrainingSetup:
    return TrainingSetup(
        lora_rank=args.lora_rank,
        grad_reduce_in_fp32=not args.no_grad_reduce_in_fp32,
        distributed_optimizer=not args.no_distributed_optimizer,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        compact_master_weights=args.compact_master_weights,
        compact_adam=args.compact_adam,
        gradient_accumulation_fusion=not args.no_gradient_accumulation_fusion,
    )


def estimate_from_argv(argv: list[str], **training: Any) -> MemoryEstimate:
    """The estimate `skyrl-megatron plan <argv>` prints (one layout; no --suggest), as numbers;
    `training` replaces TrainingSetup fields the command line has no flag for (e.g. `fused_adam`)."""
    args = build_parser().parse_args(argv)
    setup = dataclasses.replace(_training_setup(args), **training)
    return estimate(load_model_arch(args.model), _layout(args), _batch_plan(args), setup)


def _layout(args: argparse.Namespace) -> Layout:
    return Layout(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sequence_parallel=not args.no_sequence_parallel,
    )


if __name__ == "__main__":
    sys.exit(main())
