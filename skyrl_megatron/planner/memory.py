"""Per-GPU memory of one training step (policy, full fine-tune or LoRA) under a Megatron layout.

The estimate is for the pipeline stage that needs the most, in bytes. Each category is a formula:

params       bf16 weights on the GPU: 2 B per parameter (LoRA adapters included).
grads        Megatron DDP's main_grad buffers of the trainable parameters, 4 B each with
             grad_reduce_in_fp32 (else 2 B); full size on every rank, because the distributed
             optimizer reduce-scatters into the same buffer.
optimizer    fp32 main params + Adam m and v, 12 B per trainable parameter, divided by the
             distributed optimizer's shard group (DP x CP for dense parameters, expert-DP for experts),
             less the share offloaded to the CPU. With compact master weights (master_weights.py) a
             master is its bf16 model weight plus a 2 B remainder between optimizer steps: 10 B, and the
             step rebuilds the fp32 masters (2 B more per element, counted under opt. step).
activations  tensors the layers save for backward (`layer_activation_bytes`) x the micro-batches in
             flight on the stage: PP - stage under 1F1B, Megatron's warm-up count under interleaving
             (assumes a full pipeline, i.e. at least PP micro-batches per step).
transient    the largest short-lived set during backward, which does not coexist with the others:
             the logprob head's (its saved last hidden states and their gradient, the bf16 logits the
             training forward kept, one recomputed chunk's logits where not all were kept, with the eager
             chain three fp32 chunks; the output weight's fp32 accumulator only where its gradient cannot
             go into an fp32 main_grad: no [tokens, vocab] fp32 tensor exists), one layer's un-recomputed
             activations (what recomputation rebuilds, and roughly what the gradients of a layer's
             activations take otherwise), or the embedding's gradient.
opt. step    the optimizer step's temporaries, after backward freed activations and transients, 4 B
             per element of the rank's optimizer shard on the GPU for each of: fp32 copies of bf16
             gradients (Megatron's distributed optimizer makes them without grad_reduce_in_fp32), and
             torch's multi-tensor (foreach) AdamW's sqrt(v) of a whole parameter group, where Megatron
             steps with it (`fused_adam=False`; our optimizer switches to torch's fused kernel, which
             updates in place: optim.use_fused_torch_adam), plus with compact master weights their 2 B
             rebuild to fp32, unless compact adam steps them in place (compact_adam.py, on where the
             masters are compact and the gradients fp32: no fp32 temporaries, only every run's tie bits
             until the step's one host read, 1/8 B an element). The peak is
             the larger of this and activations + transient (measured on H200s: with foreach AdamW,
             2026-11-26, the step set the policy's peak in both scaled MoE examples; with fused Adam,
             2026-11-27, backward set it at Qwen3-4B and an 8-layer Qwen3-30B-A3B).
overhead     a fixed allowance: CUDA context, cuBLAS and NCCL workspaces, a sleeping colocated vLLM.

Activations assume a flash-style core attention (no [s, s] scores; ours is SDPA / varlen flash, or
TE's) and packed micro-batches of `micro_batch_tokens` tokens. This is an estimate of allocated
memory; `fits` leaves headroom for the caching allocator's fragmentation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from skyrl_megatron.planner.arch import ModelArch
from skyrl_megatron.planner.errors import PlanError
from skyrl_megatron.planner.layout import Layout, check_layout

GIB = 2**30
BF16, FP32 = 2, 4
ADAM_STATE_BYTES = 3 * FP32  # fp32 main param, exp_avg, exp_avg_sq
# a compact master between steps: its bf16 model weight (counted under params) plus an int16 remainder
COMPACT_MASTER_SAVING = FP32 - 2
# compact adam's step: one int16 word of tie bits per 16 elements of every run, kept until the step's one host read
# (compact_adam_kernels.adam_round_split)
COMPACT_ADAM_TIE_BITS_BYTES = 2 / 16
FIXED_OVERHEAD_BYTES = 3 * GIB
# The caching allocator rounds block sizes and fragments, so reserved memory runs above allocated.
USABLE_FRACTION = 0.9
DEFAULT_LOGITS_CHUNK_BYTES = 1024 * 2**20  # compute/logprobs.py's chunk budget (megatron_config.logits_chunk_mib)
DEFAULT_LOGITS_KEPT_BYTES = 4096 * 2**20  # the logits its training forward keeps (megatron_config.logits_kept_mib)
# Live chunk-sized buffers at the eager head's backward peak (`logprobs` not in fused_kernels): fp32 logits, fp32
# probabilities (with the entropy), and the bf16 projection and gradient halves.
EAGER_LOGITS_CHUNK_BUFFERS = 3
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act")


@dataclass(frozen=True)
class BatchPlan:
    """One micro-batch and how its activations are kept (Megatron's recompute and fusion settings)."""

    micro_batch_tokens: int  # packed tokens per micro-batch (megatron_config.max_tokens_per_microbatch)
    recompute: str = "none"  # none | selective | full (full: uniform, one layer per checkpoint)
    recompute_modules: tuple[str, ...] = ("core_attn",)  # with selective, as Megatron's recompute_modules
    # Megatron's fused SwiGLU (on by default: megatron_config.fused_kernels): the unfused
    # silu(a) * b keeps silu(a), one more [tokens, ffn] tensor per layer.
    swiglu_fusion: bool = True
    # `swiglu_gemm_training` in megatron_config.fused_kernels: the dense MLP keeps fc1's output only (the SwiGLU's
    # output is written again by fc2's input-gradient GEMM in the backward)
    swiglu_gemm_training: bool = False
    # the logprob head's kernels (`logprobs` in megatron_config.fused_kernels, the default): they write a chunk's
    # logit gradient over its logits; the eager chain holds fp32 copies of each chunk
    logprobs_fusion: bool = True
    logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES
    logits_kept_bytes: int = DEFAULT_LOGITS_KEPT_BYTES


@dataclass(frozen=True)
class TrainingSetup:
    """What is trained and how its gradients and optimizer state are stored."""

    lora_rank: int = 0  # 0: full fine-tune; else frozen base, adapters on every linear layer
    grad_reduce_in_fp32: bool = True
    distributed_optimizer: bool = True
    optimizer_offload_fraction: float = 0.0  # share of the optimizer state kept on the CPU
    # torch's fused Adam (what our optimizer runs: optim.use_fused_torch_adam); False: foreach AdamW
    fused_adam: bool = True
    # megatron_config.compact_master_weights: True, False or "auto" (on where the optimizer allows it)
    compact_master_weights: bool | str = "auto"
    # megatron_config.compact_adam: True, False or "auto" (on where compact masters run on fp32 gradients)
    compact_adam: bool | str = "auto"
    # Megatron's gradient_accumulation_fusion (ours by default): weight gradients go straight into the fp32
    # main_grad, the logprob head's output weight included; off, the head accumulates its own in an fp32 buffer
    gradient_accumulation_fusion: bool = True

    @property
    def steps_compact_masters_in_place(self) -> bool:
        """Whether compact adam steps the masters, "auto" settled as the workers settle it (no fp32 rebuild)."""
        if self.compact_adam == "auto":
            return self.compacts_masters and self.grad_reduce_in_fp32
        return bool(self.compact_adam)

    @property
    def head_accumulates_weight_grad(self) -> bool:
        """Whether the logprob head holds a [V, h] fp32 accumulator and its cast (no fp32 main_grad to add into)."""
        return self.lora_rank == 0 and not (self.gradient_accumulation_fusion and self.grad_reduce_in_fp32)

    @property
    def masters_can_be_compact(self) -> bool:
        """The layouts compact masters support: the distributed optimizer with nothing offloaded to the CPU."""
        return self.distributed_optimizer and self.optimizer_offload_fraction == 0.0

    @property
    def compacts_masters(self) -> bool:
        """Whether the masters are compact between steps, "auto" settled as the workers settle it."""
        if self.compact_master_weights == "auto":
            return self.masters_can_be_compact
        return bool(self.compact_master_weights)


@dataclass(frozen=True)
class StageParameters:
    """Base-model parameters on one GPU of a pipeline stage, by how they are sharded."""

    tp_sharded: int  # after the TP split (projections, dense MLPs, vocab-parallel embedding/output rows)
    replicated: int  # norms, router, row-parallel biases
    expert: int  # after the EP and ETP split

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the most-loaded pipeline stage, by category (see the module docstring)."""

    stage: int  # the most-loaded pipeline stage
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    transient_source: str
    optimizer_step: int
    overhead: int
    parameters_on_gpu: int
    layers_on_stage: int
    micro_batches_in_flight: float  # whole-stage units (fractional under interleaving)
    stage_totals: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        backward = self.activations + self.transient
        return self.params + self.grads + self.optimizer + max(backward, self.optimizer_step) + self.overhead

    def fits(self, gpu_memory_bytes: float) -> bool:
        return self.total <= USABLE_FRACTION * gpu_memory_bytes


def estimate(
    arch: ModelArch, layout: Layout, batch: BatchPlan, training: TrainingSetup = TrainingSetup()
) -> MemoryEstimate:
    """Peak training memory per GPU on the most-loaded pipeline stage (see the module docstring)."""
    check_layout(arch, layout)
    check_settings(batch, training)
    stages = [_stage_estimate(arch, layout, batch, training, stage) for stage in range(layout.pp)]
    worst = max(stages, key=lambda s: s.total)
    return dataclasses.replace(worst, stage_totals=tuple(s.total for s in stages))


def check_settings(batch: BatchPlan, training: TrainingSetup) -> None:
    """Raise a PlanError naming the flag of the first out-of-range setting."""
    unknown_modules = sorted(set(batch.recompute_modules) - set(RECOMPUTE_MODULES))
    offload = training.optimizer_offload_fraction
    checks = (
        (batch.micro_batch_tokens >= 1, "--micro-batch-tokens", f"must be positive, got {batch.micro_batch_tokens}",
         "set the token budget per micro-batch, e.g. 8192"),
        (batch.recompute in RECOMPUTE_GRANULARITIES, "--recompute", f"unknown granularity {batch.recompute!r}",
         f"use one of {', '.join(RECOMPUTE_GRANULARITIES)}"),
        (not unknown_modules, "--recompute-modules", f"unknown module(s) {', '.join(unknown_modules)}",
         f"use some of {', '.join(RECOMPUTE_MODULES)}"),
        (training.lora_rank >= 0, "--lora-rank", f"must be 0 or more, got {training.lora_rank}", "set 0 for a full fine-tune"),
        (0.0 <= offload <= 1.0, "--optimizer-offload-fraction", f"must be between 0 and 1, got {offload}", "set a share such as 0.5"),
        (training.compact_master_weights is not True or training.masters_can_be_compact,
         "--compact-master-weights", "needs the distributed optimizer with nothing offloaded to the CPU",
         "drop --no-distributed-optimizer and --optimizer-offload-fraction, or --compact-master-weights"),
        (training.compact_adam is not True or (training.compacts_masters and training.grad_reduce_in_fp32),
         "--compact-adam", "steps compact master weights on fp32 gradients",
         "keep compact master weights and fp32 gradient buffers, or set --compact-adam auto (or false)"),
    )
    for ok, flag, message, fix in checks:
        if not ok:
            raise PlanError(flag, message, fix)


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------


def stage_layers(arch: ModelArch, layout: Layout, stage: int) -> list[int]:
    """Layer indices on pipeline rank `stage`: model chunk j of rank s is chunk j * PP + s."""
    per_chunk = arch.num_layers // (layout.pp * layout.chunks)
    return [
        index
        for chunk in range(layout.chunks)
        for index in range((chunk * layout.pp + stage) * per_chunk, (chunk * layout.pp + stage + 1) * per_chunk)
    ]


def stage_parameters(arch: ModelArch, layout: Layout, stage: int) -> StageParameters:
    """The base model's parameters on one GPU of pipeline rank `stage`."""
    layers = [arch.layer_params(i) for i in stage_layers(arch, layout, stage)]
    sharded = sum(p.tp_sharded for p in layers)
    replicated = sum(p.replicated for p in layers)
    expert = sum(p.expert for p in layers)
    last = layout.pp - 1
    if stage == 0:
        sharded += arch.embedding_params
    if stage == last:
        replicated += arch.hidden_size  # final norm
        # Tied weights still need a copy of the embedding on the last stage when it is not the first.
        if not arch.tie_word_embeddings or last > 0:
            sharded += arch.vocab_size * arch.hidden_size
    return StageParameters(
        tp_sharded=sharded // layout.tp,
        replicated=replicated,
        expert=expert // (layout.ep * layout.expert_tp),
    )


def lora_adapter_parameters(arch: ModelArch, layout: Layout, stage: int, rank: int) -> tuple[int, int]:
    """(dense, expert) LoRA parameters on one GPU: A [r, in] + B [out, r] on every linear layer.

    Counted unsplit by TP (a few MB either way); each local expert has its own adapters.
    """
    if rank == 0:
        return 0, 0
    h, d = arch.hidden_size, arch.head_dim
    qkv_out = (arch.num_attention_heads + 2 * arch.num_kv_heads) * d
    attention = rank * (h + qkv_out) + rank * (arch.num_attention_heads * d + h)
    dense = expert = 0
    for index in stage_layers(arch, layout, stage):
        dense += attention
        if arch.is_moe_layer(index):
            f = arch.moe_ffn_hidden_size
            expert += (arch.num_experts // layout.ep) * rank * ((h + 2 * f) + (f + h))
        else:
            f = arch.ffn_hidden_size
            dense += rank * ((h + 2 * f) + (f + h))
    return dense, expert


# ----------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tokens:
    """Tokens of one micro-batch as a GPU sees them."""

    local: float  # on this CP rank: T / CP
    residual: float  # whose hidden states this rank keeps: local / TP under sequence parallelism
    kv: float  # whose keys and values attention keeps: all T under CP (we all-gather K/V), else local

    @classmethod
    def of(cls, layout: Layout, batch: BatchPlan) -> "_Tokens":
        local = batch.micro_batch_tokens / layout.cp
        return cls(
            local=local,
            residual=local / layout.tp if layout.sp else local,
            kv=batch.micro_batch_tokens if layout.cp > 1 else local,
        )


def layer_activation_bytes(
    arch: ModelArch, layout: Layout, batch: BatchPlan, *, moe_layer: bool, recompute: str | None = None
) -> float:
    """Bytes one layer saves for backward, per micro-batch and GPU, under `recompute` (default: the batch's)."""
    recompute = batch.recompute if recompute is None else recompute
    tokens = _Tokens.of(layout, batch)
    if recompute == "full":
        return BF16 * arch.hidden_size * tokens.residual  # only the layer's input
    modules = frozenset(batch.recompute_modules) if recompute == "selective" else frozenset()
    if moe_layer:
        mlp = _moe_bytes(arch, layout, tokens, modules, batch.swiglu_fusion)
    else:
        mlp = _dense_mlp_bytes(arch, layout, tokens, modules, batch.swiglu_fusion, batch.swiglu_gemm_training)
    return _norm_bytes(arch, tokens, modules) + _attention_bytes(arch, layout, tokens, modules) + mlp


def _norm_bytes(arch: ModelArch, tokens: _Tokens, modules: frozenset[str]) -> float:
    # Two norms per layer; each input is kept (it is also the residual), each output is the next
    # linear layer's saved input unless "layernorm" recompute discards it.
    kept = 2 if "layernorm" in modules else 4
    return kept * BF16 * arch.hidden_size * tokens.residual


def _attention_bytes(arch: ModelArch, layout: Layout, tokens: _Tokens, modules: frozenset[str]) -> float:
    q_heads, kv_heads = arch.num_attention_heads // layout.tp, arch.num_kv_heads // layout.tp
    d = arch.head_dim
    qkv = (q_heads + 2 * kv_heads) * d * tokens.local  # projection output (v is a view of it)
    q_rotated = q_heads * d * tokens.local
    k_rotated = kv_heads * d * tokens.kv
    v_gathered = kv_heads * d * tokens.kv if layout.cp > 1 else 0
    context = q_heads * d * tokens.local  # attention output = output projection's input
    # A flash-style kernel saves q, k, v, its output and the softmax statistics; recomputing
    # core_attn keeps q, k, v (checkpoint inputs) and the output (saved by the projection), so it
    # only drops the statistics.
    softmax_stats = 0 if "core_attn" in modules else FP32 * q_heads * tokens.local
    return BF16 * (qkv + q_rotated + k_rotated + v_gathered + context) + softmax_stats


def _swiglu_saved(ffn: int, fused: bool) -> int:
    """Elements per token the SwiGLU keeps beyond its input: its output, plus silu(a) when unfused."""
    return ffn if fused else 2 * ffn


def _dense_mlp_bytes(arch: ModelArch, layout: Layout, tokens: _Tokens, modules: frozenset[str], fused: bool,
                     gated_gemms: bool = False) -> float:
    if "mlp" in modules:
        return 0.0  # checkpointed whole: only its input, the norm output, is kept
    f = arch.ffn_hidden_size // layout.tp
    if gated_gemms:
        return BF16 * 2 * f * tokens.local  # fc1 output only
    return BF16 * (2 * f + _swiglu_saved(f, fused)) * tokens.local  # fc1 output (SwiGLU input) + SwiGLU


def _moe_bytes(arch: ModelArch, layout: Layout, tokens: _Tokens, modules: frozenset[str], fused: bool) -> float:
    if "moe" in modules:
        return 0.0
    router = FP32 * 2 * arch.num_experts * tokens.residual  # logits and probabilities
    # Each token goes to k experts; expert-TP ranks all-gather the tokens of their experts.
    assignments = tokens.residual * arch.experts_per_token * layout.expert_tp
    f = arch.moe_ffn_hidden_size // layout.expert_tp
    # "moe_act" recomputes the activation from the fc1 output and discards what it would keep.
    activation = 0 if "moe_act" in modules else _swiglu_saved(f, fused)
    # per assignment: permuted input (fc1 input), fc1 output, the activation's tensors, expert output
    # (kept for the weighting by the router probability)
    per_assignment = BF16 * (arch.hidden_size + 2 * f + activation + arch.hidden_size)
    return router + assignments * per_assignment


def micro_batches_in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in whole-stage units.

    1F1B: PP - stage. Interleaved: Megatron's warm-up count of model-chunk micro-batches,
    2 (PP - stage - 1) + (VPP - 1) PP, plus the one being computed, each 1/VPP of the stage.
    """
    if layout.chunks == 1:
        return layout.pp - stage
    chunk_passes = 2 * (layout.pp - stage - 1) + (layout.chunks - 1) * layout.pp + 1
    return chunk_passes / layout.chunks


# ----------------------------------------------------------------------------------------------
# One stage
# ----------------------------------------------------------------------------------------------


def _stage_estimate(arch: ModelArch, layout: Layout, batch: BatchPlan, training: TrainingSetup, stage: int) -> MemoryEstimate:
    base = stage_parameters(arch, layout, stage)
    lora_dense, lora_expert = lora_adapter_parameters(arch, layout, stage, training.lora_rank)
    full_finetune = training.lora_rank == 0
    trainable_dense = base.tp_sharded + base.replicated if full_finetune else lora_dense
    trainable_expert = base.expert if full_finetune else lora_expert

    grad_bytes = FP32 if training.grad_reduce_in_fp32 else BF16
    dense_shards = layout.dp * layout.cp if training.distributed_optimizer else 1
    expert_shards = layout.expert_dp if training.distributed_optimizer else 1
    on_gpu_share = 1.0 - training.optimizer_offload_fraction
    shard_on_gpu = (trainable_dense / dense_shards + trainable_expert / expert_shards) * on_gpu_share
    # between steps; the step itself rebuilds compact masters to fp32
    optimizer = (ADAM_STATE_BYTES - COMPACT_MASTER_SAVING * training.compacts_masters) * shard_on_gpu

    layers = stage_layers(arch, layout, stage)
    saved_per_pass = sum(layer_activation_bytes(arch, layout, batch, moe_layer=arch.is_moe_layer(i)) for i in layers)
    in_flight = micro_batches_in_flight(layout, stage)
    transient, source = max(_transients(arch, layout, batch, training, layers, stage), key=lambda t: t[0])

    parameters_on_gpu = base.total + lora_dense + lora_expert
    return MemoryEstimate(
        stage=stage,
        params=BF16 * parameters_on_gpu,
        grads=grad_bytes * (trainable_dense + trainable_expert),
        optimizer=round(optimizer),
        activations=round(in_flight * saved_per_pass),
        transient=round(transient),
        transient_source=source,
        optimizer_step=round(shard_on_gpu * _step_temporary_bytes(training)),
        overhead=FIXED_OVERHEAD_BYTES,
        parameters_on_gpu=parameters_on_gpu,
        layers_on_stage=len(layers),
        micro_batches_in_flight=in_flight,
    )


def _step_temporary_bytes(training: TrainingSetup) -> float:
    """Bytes per element of the GPU's optimizer shard that the optimizer step adds (module docstring)."""
    if training.steps_compact_masters_in_place:
        return COMPACT_ADAM_TIE_BITS_BYTES  # one pass over each run of compact masters, no torch AdamW, no rebuild
    fp32_temporaries = int(not training.grad_reduce_in_fp32) + int(not training.fused_adam)
    return FP32 * fp32_temporaries + COMPACT_MASTER_SAVING * training.compacts_masters


def _transients(
    arch: ModelArch, layout: Layout, batch: BatchPlan, training: TrainingSetup, layers: list[int], stage: int
) -> list[tuple[float, str]]:
    full_finetune = training.lora_rank == 0
    working = max(layer_activation_bytes(arch, layout, batch, moe_layer=arch.is_moe_layer(i), recompute="none") for i in layers)
    candidates = [(working, "one layer's backward working set")]
    vocab_rows = arch.vocab_size // layout.tp
    if stage == 0 and full_finetune:
        candidates.append((BF16 * vocab_rows * arch.hidden_size, "embedding gradient"))
    if stage == layout.pp - 1:
        candidates.append((_logprob_head_bytes(arch, layout, batch, training), "logprob head"))
    return candidates


def _logprob_head_bytes(arch: ModelArch, layout: Layout, batch: BatchPlan, training: TrainingSetup) -> float:
    """The head's backward (compute/logprobs.py): its saved inputs and the hidden states' gradient, the logits kept
    from the forward, the chunk buffers of the logits it recomputes, and the output weight's fp32 accumulator where
    its gradient cannot go straight into main_grad."""
    tokens = _Tokens.of(layout, batch)
    vocab_rows = arch.vocab_size // layout.tp
    hidden = BF16 * arch.hidden_size * tokens.local  # the gathered last hidden states, and their gradient
    saved = hidden + 2 * FP32 * tokens.local  # with the log-partition and logprob per token
    kept = _kept_logits_bytes(tokens.local, vocab_rows, batch)
    chunk = min(batch.logits_chunk_bytes, FP32 * tokens.local * vocab_rows)  # a chunk's fp32 logits
    if not batch.logprobs_fusion:
        chunks = EAGER_LOGITS_CHUNK_BUFFERS * chunk
    elif kept < BF16 * tokens.local * vocab_rows:
        chunks = chunk / 2  # one recomputed chunk's bf16 logits, its gradient written over them
    else:
        chunks = 0.0  # every chunk's logits kept: the gradient is written over them
    weight_grad = (FP32 + BF16) * vocab_rows * arch.hidden_size if training.head_accumulates_weight_grad else 0
    return saved + hidden + kept + chunks + weight_grad


def _kept_logits_bytes(tokens: float, vocab_rows: int, batch: BatchPlan) -> float:
    """The bf16 logits the training forward keeps for its backward: whole chunks within the budget,
    as compute/logprobs.py's `kept_logits_tokens` chooses them."""
    if tokens * vocab_rows * BF16 <= batch.logits_kept_bytes:
        return tokens * vocab_rows * BF16
    chunk_tokens = max(1, batch.logits_chunk_bytes // (FP32 * vocab_rows))
    return batch.logits_kept_bytes // (vocab_rows * BF16) // chunk_tokens * chunk_tokens * vocab_rows * BF16
