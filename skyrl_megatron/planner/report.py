"""Plain-text reports of a memory estimate and of layout suggestions (what `skyrl-megatron plan` prints)."""

from __future__ import annotations

from skyrl_megatron.planner.arch import ModelArch
from skyrl_megatron.planner.layout import Layout
from skyrl_megatron.planner.memory import GIB, USABLE_FRACTION, BatchPlan, MemoryEstimate, TrainingSetup
from skyrl_megatron.planner.suggest import Suggestion


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe_model(arch: ModelArch) -> list[str]:
    head = f"{arch.name} ({arch.model_type}): {count(arch.num_parameters())} parameters"
    if arch.is_moe:
        head += f", {count(arch.num_active_parameters())} active per token"
    layers = f"{arch.num_layers} layers"
    if arch.is_moe:
        layers += f" ({len(arch.moe_layers)} MoE: {arch.num_experts} experts, {arch.experts_per_token} per token)"
    shape = f"{layers}, hidden {arch.hidden_size}, {arch.num_attention_heads}/{arch.num_kv_heads} q/kv heads, vocab {arch.vocab_size}"
    return [f"model       {head}", f"            {shape}"]


def describe_layout(arch: ModelArch, layout: Layout) -> str:
    text = f"{layout.world_size} GPUs ({layout.nodes} x {layout.gpus_per_node}): TP {layout.tp}{' + SP' if layout.sp else ''}"
    text += f", PP {layout.pp}" + (f" x VPP {layout.vpp}" if layout.vpp else "")
    text += f", CP {layout.cp}, DP {layout.dp}"
    if arch.is_moe:
        text += f" | experts: EP {layout.ep}, ETP {layout.expert_tp}, expert-DP {layout.expert_dp}"
    return f"layout      {text}"


def describe_training(batch: BatchPlan, training: TrainingSetup) -> list[str]:
    recompute = batch.recompute
    if recompute == "selective":
        recompute += f" ({', '.join(batch.recompute_modules)})"
    tuning = f"LoRA rank {training.lora_rank} (frozen base)" if training.lora_rank else "full fine-tune"
    swiglu = "fused" if batch.swiglu_fusion else "unfused"
    if batch.swiglu_gemm_training:
        swiglu = "GEMM-fused"  # swiglu_gemm_training: the dense MLP keeps fc1's output only
    first = f"{batch.micro_batch_tokens} tokens per micro-batch (packed), recompute {recompute}, {swiglu} SwiGLU, {tuning}"
    grads = "fp32" if training.grad_reduce_in_fp32 else "bf16"
    optimizer = "distributed" if training.distributed_optimizer else "unsharded"
    masters = "compact main params (bf16 + 16-bit remainder between steps)" if training.compacts_masters else "fp32 main params"
    adam = "Adam stepping them in place" if training.steps_compact_masters_in_place else "Adam"
    second = f"bf16 params, {grads} grads, {masters} + {adam} ({optimizer}"
    if training.optimizer_offload_fraction:
        second += f", {training.optimizer_offload_fraction:.0%} on the CPU"
    lines = [f"training    {first}", f"            {second})"]
    head = [] if batch.logprobs_fusion else ["eager (fp32 chunks)"]
    if training.head_accumulates_weight_grad:
        head.append("output weight gradient in an fp32 buffer of its own")
    if head:
        lines.append(f"            logprob head: {', '.join(head)}")
    return lines


def _micro_batches(n: float) -> str:
    return f"{n:g} micro-batch" + ("" if n == 1 else "es")


def _limit(gpu_memory_bytes: float) -> str:
    return f"{gpu_memory_bytes / GIB:g} GiB (limit {gib(USABLE_FRACTION * gpu_memory_bytes)} at {USABLE_FRACTION:.0%} usable)"


def format_estimate(
    arch: ModelArch, layout: Layout, batch: BatchPlan, training: TrainingSetup, result: MemoryEstimate, gpu_memory_bytes: float
) -> str:
    optimizer_shards = f"dense / {layout.dp * layout.cp} (DP x CP)"
    if arch.is_moe:
        optimizer_shards += f", experts / {layout.expert_dp} (expert-DP)"
    in_flight = f"{result.layers_on_stage} layers x {_micro_batches(result.micro_batches_in_flight)} in flight"
    verdict = "fits" if result.fits(gpu_memory_bytes) else "DOES NOT FIT"
    rows = (
        ("params", result.params, f"{count(result.parameters_on_gpu)} parameters, bf16"),
        ("grads", result.grads, "main_grad buffers of the trainable parameters"),
        ("optimizer", result.optimizer, f"{'compact' if training.compacts_masters else 'fp32'} main params + Adam m, v; {optimizer_shards}"),
        ("activations", result.activations, f"saved for backward: {in_flight}"),
        ("transient", result.transient, f"largest backward transient: {result.transient_source}"),
        ("opt. step", result.optimizer_step, "the step's temporaries over the shard; peaks apart from the two above"),
        ("overhead", result.overhead, "CUDA context, cuBLAS/NCCL workspaces (fixed allowance)"),
        ("total", result.total, f"{verdict} {_limit(gpu_memory_bytes)}"),
    )
    where = f" on pipeline rank {result.stage} (0-based, the most loaded of {layout.pp})" if layout.pp > 1 else ""
    lines = [*describe_model(arch), describe_layout(arch, layout), *describe_training(batch, training), "", "per GPU" + where]
    lines += [f"  {label:<12} {gib(num_bytes):>11}  {note}" for label, num_bytes, note in rows]
    if layout.pp > 1:
        lines.append("  per stage    " + ", ".join(gib(total) for total in result.stage_totals))
    return "\n".join(lines)


def format_suggestions(
    arch: ModelArch,
    nodes: int,
    gpus_per_node: int,
    batch: BatchPlan,
    training: TrainingSetup,
    suggestions: list[Suggestion],
    gpu_memory_bytes: float,
    top: int,
) -> str:
    lines = [*describe_model(arch), *describe_training(batch, training), ""]
    world = nodes * gpus_per_node
    if not suggestions:
        lines.append(f"no layout of {world} GPUs ({nodes} x {gpus_per_node}) fits {_limit(gpu_memory_bytes)}")
        lines.append("try more GPUs, --recompute full, a smaller --micro-batch-tokens, --lora-rank or --optimizer-offload-fraction")
        return "\n".join(lines)
    lines.append(f"layouts of {world} GPUs ({nodes} x {gpus_per_node}) that fit {_limit(gpu_memory_bytes)}, best first:")
    header = f"  {'TP':>3} {'PP':>3} {'CP':>3} {'DP':>4}"
    header += f" {'EP':>4} {'ETP':>4} {'EDP':>4}" if arch.is_moe else ""
    lines.append(header + f" {'per GPU':>11}  stage")
    for suggestion in suggestions[:top]:
        layout, result = suggestion.layout, suggestion.estimate
        row = f"  {layout.tp:>3} {layout.pp:>3} {layout.cp:>3} {layout.dp:>4}"
        row += f" {layout.ep:>4} {layout.expert_tp:>4} {layout.expert_dp:>4}" if arch.is_moe else ""
        lines.append(row + f" {gib(result.total):>11}  {result.stage:>5}")
    if len(suggestions) > top:
        lines.append(f"  ... {len(suggestions) - top} more (raise --top to see them)")
    return "\n".join(lines)
