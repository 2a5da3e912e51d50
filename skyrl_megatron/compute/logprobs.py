"""Per-token logprobs (and entropy) of given labels, straight from the last hidden state.

RL needs log p(label_t | prefix) for every response token, at the sampling temperature, and for
training their gradients. The obvious route, logits -> log_softmax -> gather, materialises a
[tokens, vocab] fp32 tensor (and as much again for its gradient): 8k tokens of a 152k vocabulary
are 5 GB. Here the output projection, the softmax statistics and the label lookup are fused and
walked in chunks of tokens, so only one chunk of logits exists at a time:

* vocab-parallel: each TP rank holds the rows [V/TP, h] of the output weight; the max and the
  partition sums are all-reduced over the TP group, and the label's logit comes from the rank
  that owns it. Labels are global vocabulary ids.
* memory: forward keeps the hidden states, per-token log-sum-exp and entropy; backward recomputes
  each chunk's logits from them. The transient peak is one fp32 chunk of logits, two with entropy.
  Where the gradients are wanted, forward may also keep whole chunks of logits (in the GEMM's dtype),
  up to a byte budget per call: backward then takes them instead of the recompute, one of the head's
  four [tokens, V/TP, h] GEMMs in training.
* precision: the projection runs in the weight's dtype (bf16 in production) and its output is
  cast to fp32 before the softmax, as Megatron's own cross entropy does, so the results equal
  the materialised path's.
* fused (GPU, `fused_kernels: [logprobs]`): the softmax statistics and the logits' gradient are
  each one generated kernel per chunk that reads the GEMM's bf16 logits once, in place of a
  dozen fp32 passes over [tokens, V/TP] (cast, shift, exp, sums, scatter, cast back). Shards
  combine by rescaling their partial sums to the global max, so the kernel needs no collective.

Two entry points: :func:`vocab_parallel_logprobs` on tensors, and :class:`LogprobOutputProcessor`,
a hook for ``GPTModel.forward(output_processor=...)`` that makes the model return
:class:`TokenLogprobs` instead of logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from skyrl_megatron.compute import logprob_gemm
from skyrl_megatron.host_copies import to_device
from skyrl_megatron.model.layers.fusions import compile_kernel
from skyrl_megatron.model.layers.wgrad import wgrad_gemm_accum_fp32

# 1 GiB of fp32 logits per chunk (1,766 tokens at vocab 151,936): 256 MiB (441 tokens) cost a 4B training step 8%
# on an H200 (measured 2026-11-27), in 19 chunks per 8k-token micro-batch
DEFAULT_LOGITS_CHUNK_BYTES = 1024 * 2**20
# logits kept from a training forward for its backward: 4 GiB holds an 8k-token micro-batch's bf16 logits at
# vocab 151,936 and 14k tokens of a 16k one (megatron_config.logits_kept_mib)
DEFAULT_LOGITS_KEPT_BYTES = 4096 * 2**20
_FP32_BYTES = 4


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token results, shaped like the labels; 0 at masked positions."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class LogprobTargets:
    """What to score in one micro-batch (the ``output_processor_context`` of a model call).

    `labels[b, t]` is the global vocabulary id that follows position t (the caller shifts the
    tokens); positions where `mask` is false (or 0) cost nothing and come back as 0. Both are
    [b, s], for the sequence positions this rank's model sees (its own slice under context
    parallelism), and identical on the ranks of a TP group (their collectives run over the kept
    tokens).
    """

    labels: torch.Tensor
    mask: torch.Tensor | None = None
    # where `mask` holds in Megatron's [s, b] order, flattened: taken from the host's copy of the mask
    # when the micro-batch is prepared, so the head needs no device-to-host read (None: found on the device)
    kept: torch.Tensor | None = None

    @classmethod
    def on_device(cls, labels: torch.Tensor, mask: torch.Tensor, device) -> LogprobTargets:
        """Host `labels` and `mask` [b, s] moved to `device` (without waiting for it), with `kept` found on the host
        first."""
        kept = mask.t().reshape(-1).nonzero().squeeze(1)
        return cls(labels=to_device(labels, device), mask=to_device(mask, device), kept=to_device(kept, device))


def chunk_tokens_for(vocab_local: int, logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk such that one chunk's fp32 logits [tokens, vocab_local] fit the budget."""
    return max(1, logits_chunk_bytes // (_FP32_BYTES * vocab_local))


def kept_logits_tokens(num_tokens: int, chunk_tokens: int, vocab_local: int, element_bytes: int,
                       kept_bytes: int) -> int:
    """Leading tokens whose logits a training forward keeps: whole chunks within `kept_bytes`."""
    if num_tokens * vocab_local * element_bytes <= kept_bytes:
        return num_tokens
    return kept_bytes // (vocab_local * element_bytes) // chunk_tokens * chunk_tokens


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    chunk_tokens: int | None = None,
    fused: bool = False,
    kept_logits_bytes: int = 0,
    into_main_grad: bool = False,
    lse_gemm: bool = False,
) -> TokenLogprobs:
    """log softmax(hidden @ weight.T / temperature)[label] per token, without the full logits.

    `hidden` is [..., h] ([T, h] or Megatron's [s, b, h]); `weight` is this rank's vocabulary shard
    [V/TP, h] of the output projection (the whole [V, h] when `tp_group` is None). `labels` and
    `mask` have the shape of `hidden` without its last dimension, after the sequence-parallel
    gather when `sequence_parallel` is set (then `hidden` holds this rank's slice of the first
    dimension, as in a ColumnParallelLinear). Gradients flow to `hidden` and `weight` from both
    outputs. `kept`, where given, lists `mask`'s true positions in its flattened order (the caller's
    host copy spares the device read). `chunk_tokens` defaults to a 1 GiB fp32 logits chunk. `fused`
    runs each chunk's elementwise work as Triton kernels (GPU). Where gradients are wanted, up to
    `kept_logits_bytes` of logits (whole chunks) stay from forward for the backward. `into_main_grad`
    (Megatron's `gradient_accumulation_fusion`): where `weight` has an fp32 DDP `main_grad`, its gradient
    accumulates there directly, as Megatron's fused linear layers do, and the weight is marked
    `grad_added_to_main_grad`. `lse_gemm` takes the log-sum-exp and the label's logit from the GEMM's epilogue
    (`logprob_gemm.py`, CUDA; every pass whose logprobs are compared must take it alike).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    hidden = _enter_vocab_parallel_region(hidden, tp_group, sequence_parallel)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}")
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match labels {tuple(labels.shape)}")
    chunk_tokens = chunk_tokens or chunk_tokens_for(weight.shape[0])

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if mask is not None:
        # Scoring only the kept tokens makes padding free; finding them here costs a host sync per call.
        if kept is None:
            kept = mask.reshape(-1).nonzero().squeeze(1)
        flat_hidden = flat_hidden.index_select(0, kept)
        flat_labels = flat_labels.index_select(0, kept)

    keep_tokens = 0
    if kept_logits_bytes and torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad):
        keep_tokens = kept_logits_tokens(flat_hidden.shape[0], chunk_tokens, weight.shape[0],
                                         torch.promote_types(hidden.dtype, weight.dtype).itemsize, kept_logits_bytes)
    options = _HeadOptions(temperature, with_entropy, chunk_tokens, tp_group, _chunk_kernels(fused, hidden.device, lse_gemm),
                           keep_tokens, into_main_grad)
    logprobs, entropy = _ChunkedVocabParallelLogprobs.apply(flat_hidden, weight, flat_labels, options)
    if mask is not None:
        logprobs = _scatter_kept(logprobs, kept, labels.numel())
        entropy = _scatter_kept(entropy, kept, labels.numel()) if with_entropy else None
    return TokenLogprobs(
        logprobs=logprobs.view(labels.shape),
        entropy=entropy.view(labels.shape) if with_entropy else None,
    )


@dataclass(frozen=True)
class LogprobOutputProcessor:
    """``GPTModel.forward(output_processor=...)`` hook: returns :class:`TokenLogprobs` [b, s].

    Pass the micro-batch's :class:`LogprobTargets` as ``output_processor_context``. The model's
    last hidden state goes through the output layer's (or the tied embedding's) weight shard with
    the output layer's TP group and sequence-parallel setting, so no logits are ever produced.
    """

    temperature: float = 1.0
    with_entropy: bool = False
    logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES
    fused: bool = False  # Triton kernels for each chunk (GPU; `fused_kernels: [logprobs]`)
    lse_gemm: bool = False  # the statistics in the GEMM's epilogue (GPU; `fused_kernels: [lse_gemm]`)
    logits_kept_bytes: int = 0  # logits a training forward keeps for its backward (`logits_kept_mib`)

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer: Any,
        output_weight: torch.Tensor | None,
        context: LogprobTargets,
        config: Any,
        **_unused: Any,
    ) -> TokenLogprobs:
        if config.defer_embedding_wgrad_compute:
            raise NotImplementedError("defer_embedding_wgrad_compute expects the output layer's own backward")
        weight = output_weight if output_weight is not None else output_layer.weight
        # MuP multiplies the logits by mup_output_mult (GPTModel._scale_logits); fold it into the temperature.
        logit_multiplier = config.mup_output_mult if config.use_mup else 1.0
        mask = context.mask.t() if context.mask is not None else None
        result = vocab_parallel_logprobs(
            hidden_states,
            weight,
            context.labels.t(),  # [b, s] -> Megatron's [s, b]
            mask=mask,
            kept=context.kept,
            temperature=self.temperature / logit_multiplier,
            with_entropy=self.with_entropy,
            tp_group=output_layer.tp_group,
            sequence_parallel=output_layer.sequence_parallel,
            chunk_tokens=chunk_tokens_for(weight.shape[0], self.logits_chunk_bytes),
            fused=self.fused,
            kept_logits_bytes=self.logits_kept_bytes,
            into_main_grad=bool(config.gradient_accumulation_fusion),
            lse_gemm=self.lse_gemm,
        )
        return TokenLogprobs(
            logprobs=result.logprobs.t(),
            entropy=result.entropy.t() if result.entropy is not None else None,
        )


def _enter_vocab_parallel_region(
    hidden: torch.Tensor, tp_group: ProcessGroup | None, sequence_parallel: bool
) -> torch.Tensor:
    """What a ColumnParallelLinear does to its input: every TP rank needs all tokens, and in
    backward each rank's hidden-state gradient covers only its vocab shard, so the partial grads
    are summed (all-reduce), or summed and re-split along the sequence (reduce-scatter) under SP."""
    if tp_group is None or tp_group.size() == 1:
        return hidden
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    return copy_to_tensor_model_parallel_region(hidden, group=tp_group)


def _scatter_kept(values: torch.Tensor, kept: torch.Tensor, numel: int) -> torch.Tensor:
    """Place the kept tokens' values back among zeros (differentiable w.r.t. `values`)."""
    return values.new_zeros(numel).index_copy(0, kept, values)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, tp_group: ProcessGroup | None) -> None:
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)


def _local_targets(labels: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as column indices into this shard (0 where another rank owns them), and ownership."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return torch.where(owned, local, 0), owned


@dataclass(frozen=True)
class _HeadOptions:
    """How one call walks its chunks: the Function's arguments besides the tensors."""

    temperature: float
    with_entropy: bool
    chunk_tokens: int
    tp_group: ProcessGroup | None
    kernels: _ChunkKernels
    keep_tokens: int  # leading tokens whose logits forward keeps for the backward
    into_main_grad: bool  # the weight's gradient accumulates into its fp32 DDP `main_grad`, where it has one


class _ChunkedVocabParallelLogprobs(torch.autograd.Function):
    """hidden [T, h], weight [V/TP, h], labels [T] -> logprobs [T], entropy [T] or None (fp32).

    Each chunk is handled in its own function so that its [tokens, V/TP] buffers are freed before
    the next chunk allocates (a loop variable would keep the previous chunk alive meanwhile). The
    logits of the first `keep_tokens` tokens are written into one buffer that the first backward
    consumes (a second backward, with the graph retained, recomputes them).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, options: _HeadOptions):
        tp_group = options.tp_group
        vocab_start = (tp_group.rank() if tp_group is not None else 0) * weight.shape[0]
        num_tokens = hidden.shape[0]
        logprobs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        log_partition = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if options.with_entropy else None
        kept_logits = None
        if options.keep_tokens:
            kept_logits = torch.empty(options.keep_tokens, weight.shape[0], device=hidden.device,
                                      dtype=torch.promote_types(hidden.dtype, weight.dtype))
        for start in range(0, num_tokens, options.chunk_tokens):
            rows = slice(start, start + options.chunk_tokens)
            _forward_chunk(
                options.kernels,
                hidden[rows],
                weight,
                labels[rows],
                options.temperature,
                vocab_start,
                tp_group,
                logprobs=logprobs[rows],
                log_partition=log_partition[rows],
                entropy=entropy[rows] if entropy is not None else None,
                logits_out=kept_logits[rows] if start < options.keep_tokens else None,
            )

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, labels, log_partition, entropy)
        ctx.options, ctx.vocab_start = options, vocab_start
        # not a saved tensor: the backward writes the gradients over it, and drops it when done
        ctx.kept_logits = kept_logits
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, log_partition, entropy = ctx.saved_tensors
        kept_logits, ctx.kept_logits = ctx.kept_logits, None
        options = ctx.options
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_logprobs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(log_partition)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        main_grad = getattr(weight, "main_grad", None) if need_weight and options.into_main_grad else None
        if main_grad is not None and main_grad.dtype != torch.float32:
            main_grad = None  # a bf16 main_grad (grad_reduce_in_fp32 false): DDP's hook adds the cast gradient
        grad_weight = None
        if need_weight:
            # fp32 accumulation across chunks, into main_grad or into a buffer cast once at the end
            grad_weight = main_grad if main_grad is not None else torch.zeros(
                weight.shape, dtype=torch.float32, device=weight.device)
        keep_tokens = kept_logits.shape[0] if kept_logits is not None else 0
        for start in range(0, hidden.shape[0], options.chunk_tokens):
            rows = slice(start, start + options.chunk_tokens)
            _backward_chunk(
                options.kernels,
                hidden[rows],
                weight,
                labels[rows],
                options.temperature,
                ctx.vocab_start,
                log_partition=log_partition[rows],
                entropy=entropy[rows] if grad_entropy is not None else None,
                grad_logprobs=grad_logprobs[rows],
                grad_entropy=grad_entropy[rows] if grad_entropy is not None else None,
                grad_hidden=grad_hidden[rows] if need_hidden else None,
                grad_weight=grad_weight,
                logits=kept_logits[rows] if start < keep_tokens else None,
            )
        if main_grad is not None:
            grad_weight = _added_to_main_grad(weight)
        elif need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Mark `weight` as Megatron's fused linear layers do once they have added into its `main_grad`, and
    return the placeholder gradient AccumulateGrad needs: never read, so uninitialised, unless the weight is
    shared with the embedding (`zero_out_wgrad`), whose own gradient DDP's hook then adds with it."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def _forward_chunk(
    kernels: _ChunkKernels,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_start: int,
    tp_group: ProcessGroup | None,
    *,
    logprobs: torch.Tensor,
    log_partition: torch.Tensor,
    entropy: torch.Tensor | None,
    logits_out: torch.Tensor | None = None,
) -> None:
    """Fill one chunk's logprobs, log-partition (lse) and entropy; two collectives over TP. The
    chunk's logits go to `logits_out` where given (kept for the backward), else to a temporary.

    Each shard's sums are taken against its own max m_r; rescaling by exp(m_r - M) to the global
    max M makes them global: sum exp(z - M) = e s_r and sum exp(z - M)(z - M) = e (t_r + (m_r - M) s_r).
    So the statistics kernel holds no collective, and all per-token sums (the partition sum, the
    label's logit, where non-owners add 0, and the entropy's) travel in one SUM all-reduce.

    With the epilogue GEMM (`kernels.lse_gemm`, `logprob_gemm.py`) the logprob is the label's logit less the
    log-sum-exp, both from the GEMM's fp32 accumulator: a shard's log-sum-exp l_r is the pair (m_r, s_r) = (l_r, 1).
    Without entropy or kept logits no logits are written; with them, the statistics kernel still reads the stored
    logits for the entropy and for the log-partition the backward uses.
    """
    target, owned = _local_targets(labels, vocab_start, weight.shape[0])
    accumulator_lse, label_logit, weighted = None, None, None
    if kernels.lse_gemm is not None and kernels.lse_gemm_takes(hidden, weight, temperature):
        if entropy is not None and logits_out is None:
            logits_out = hidden.new_empty(hidden.shape[0], weight.shape[0])
        accumulator_lse, label_logit = kernels.lse_gemm(hidden, weight, target, owned, logits_out)
        logits = logits_out  # None in a scoring pass: no logits written
    else:
        logits = torch.mm(hidden, weight.t(), out=logits_out) if logits_out is not None else hidden @ weight.t()
        if logits_out is not None and kernels.statistics_overwrite_fp32 and logits.dtype == torch.float32:
            logits = logits.clone()
    pairs = []  # (max, sum) pairs: the first gives the log-partition, the last the logprob's
    if logits is not None:
        shard_max, shard_sum, target_logit, weighted = kernels.statistics(
            logits, target, owned, temperature, entropy is not None
        )
        pairs.append((shard_max, shard_sum))
        if label_logit is None:
            label_logit = target_logit
    if accumulator_lse is not None:
        pairs.append((accumulator_lse, torch.ones_like(accumulator_lse)))

    shard_maxima = torch.stack([pair_max for pair_max, _ in pairs], dim=1)
    row_max = shard_maxima.clone()
    _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)
    rescale = (shard_maxima - row_max).exp()
    stats = [pair_sum * rescale[:, i] for i, (_, pair_sum) in enumerate(pairs)] + [label_logit]
    if entropy is not None:
        shift = shard_maxima[:, 0] - row_max[:, 0]
        stats.append((weighted + shift * pairs[0][1]) * rescale[:, 0])
    stats = torch.stack(stats, dim=1)
    _all_reduce(stats, dist.ReduceOp.SUM, tp_group)

    log_sum_exp_shifted = stats[:, 0].log()
    log_partition.copy_(row_max[:, 0] + log_sum_exp_shifted)
    # the logprob's partition: the last pair's (the accumulator's, with the epilogue GEMM)
    last = len(pairs) - 1
    logprobs.copy_(stats[:, len(pairs)] - (row_max[:, last] + stats[:, last].log()))
    if entropy is not None:
        # H = lse - E_p[z] = log sum exp(z - max) - E_p[z - max]
        entropy.copy_(log_sum_exp_shifted - stats[:, len(pairs) + 1] / stats[:, 0])


def _backward_chunk(
    kernels: _ChunkKernels,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_start: int,
    *,
    log_partition: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    logits: torch.Tensor | None = None,
) -> None:
    """Recompute one chunk's logits (unless forward kept them: `logits`, which the fused gradient kernel
    overwrites); write its hidden grad, add its weight grad.

    No collective is needed: p_v = exp(z_v - lse) uses the global lse, and the hidden grad is this
    shard's partial sum, which the region mapping in front of the Function reduces over TP. The
    weight's gradient accumulates in fp32 across chunks through the same GEMM as Megatron's
    gradient-accumulation fusion (bf16 inputs, fp32 output on CUDA): adding a bf16 [V, h] product
    into the fp32 buffer instead cost four weight-sized passes per chunk.
    """
    target, owned = _local_targets(labels, vocab_start, weight.shape[0])
    grad_logits = kernels.logit_grads(
        logits if logits is not None else hidden @ weight.t(), log_partition, grad_logprobs, target, owned, temperature, entropy, grad_entropy
    ).to(weight.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden)
    if grad_weight is not None:
        wgrad_gemm_accum_fp32(hidden, grad_logits, grad_weight)


# ---- the elementwise work of a chunk, eager or generated (fused_kernels: [logprobs]) ----------------
#
# Both read the chunk's logits [n, V/TP] as the GEMM wrote them (bf16 in production) and compute in
# fp32. The eager chain reuses one fp32 copy in place (one chunk buffer, two with the entropy); the
# generated kernels read the logits once per direction and write nothing [n, V]-sized but the
# gradient.


def _shard_statistics_eager(logits, target, owned, temperature: float, with_entropy: bool):
    """This shard's max m, sum exp(z - m), the label's logit (0 where another shard owns it) and,
    for the entropy, sum exp(z - m)(z - m), of the tempered logits z."""
    z = logits.float()  # the GEMM's own buffer when fp32: this function may overwrite it
    if temperature != 1.0:
        z = z.div_(temperature)
    target_logit = torch.where(owned, z.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)
    shard_max = z.amax(dim=1)
    shifted = z.sub_(shard_max.unsqueeze(1))
    if not with_entropy:  # the exponentials overwrite the logits
        return shard_max, shifted.exp_().sum(dim=1), target_logit, None
    exp_shifted = shifted.exp()
    return shard_max, exp_shifted.sum(dim=1), target_logit, shifted.mul_(exp_shifted).sum(dim=1)


def _logit_grads_eager(logits, log_partition, g_logprob, target, owned, temperature: float, entropy, g_entropy):
    """d loss / d z_v: g_logprob (1[v = label] - p_v) - g_entropy p_v (log p_v + H), in fp32.

    (d logprob / dz_v = 1[v = label] - p_v;  d entropy / dz_v = -p_v (z_v - E_p[z]) = -p_v (log p_v + H))
    """
    z = logits.float()
    if temperature != 1.0:
        z = z.div_(temperature)
    log_probs = z.sub_(log_partition.unsqueeze(1))
    g = g_logprob.unsqueeze(1)
    if entropy is None:
        grad = log_probs.exp_().mul_(-g)
    else:
        probs = log_probs.exp()
        coefficient = log_probs.add_(entropy.unsqueeze(1)).mul_(g_entropy.unsqueeze(1)).add_(g)
        grad = probs.mul_(coefficient).neg_()
    grad.scatter_add_(1, target.unsqueeze(1), torch.where(owned.unsqueeze(1), g, 0.0))
    return grad.div_(temperature) if temperature != 1.0 else grad


def _shard_statistics_generated(logits, target, owned, temperature: float, with_entropy: bool):
    """`_shard_statistics_eager` as one reduction over the logits, without in-place updates."""
    z = logits.float() / temperature
    shard_max = z.amax(dim=1)
    shifted = z - shard_max.unsqueeze(1)
    exp_shifted = shifted.exp()
    target_logit = torch.where(owned, z.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)
    weighted = (exp_shifted * shifted).sum(dim=1) if with_entropy else None
    return shard_max, exp_shifted.sum(dim=1), target_logit, weighted


def _logit_grads_generated(logits, log_partition, g_logprob, target, owned, temperature: float, entropy, g_entropy):
    """`_logit_grads_eager` as one elementwise kernel (the label's term by column comparison),
    written in the logits' dtype."""
    z = logits.float() / temperature
    log_p = z - log_partition.unsqueeze(1)
    coefficient = g_logprob.unsqueeze(1)
    if entropy is not None:
        coefficient = coefficient + (log_p + entropy.unsqueeze(1)) * g_entropy.unsqueeze(1)
    columns = torch.arange(z.shape[1], device=z.device)
    is_label = (columns.unsqueeze(0) == target.unsqueeze(1)) & owned.unsqueeze(1)
    grad = torch.where(is_label, g_logprob.unsqueeze(1), 0.0) - log_p.exp() * coefficient
    return (grad / temperature).to(logits.dtype)


@dataclass(frozen=True)
class _ChunkKernels:
    statistics: Callable
    logit_grads: Callable
    statistics_overwrite_fp32: bool = False  # the statistics reuse fp32 logits as their working buffer
    # the GEMM with the log-sum-exp and the label's logit in its epilogue (`logprob_gemm.statistics`), or None, and
    # which operands it takes (`logprob_gemm.takes`; the two-kernel path runs the others)
    lse_gemm: Callable | None = None
    lse_gemm_takes: Callable = logprob_gemm.takes


_EAGER_KERNELS = _ChunkKernels(_shard_statistics_eager, _logit_grads_eager, statistics_overwrite_fp32=True)
_GENERATED_KERNELS = _ChunkKernels(compile_kernel(_shard_statistics_generated), compile_kernel(_logit_grads_generated))


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda"


def _chunk_kernels(fused: bool, device: torch.device, lse_gemm: bool = False) -> _ChunkKernels:
    """Eager chains unless `fused`; fused: the Triton kernels where Triton runs (CUDA), else the generated ones.
    `lse_gemm` adds the epilogue GEMM (`logprob_gemm.py`) on CUDA."""
    if not fused:
        kernels = _EAGER_KERNELS
    elif _triton_runs_on(device):
        from skyrl_megatron.compute import logprob_kernels

        kernels = _ChunkKernels(logprob_kernels.shard_statistics, logprob_kernels.logit_grads_)
    else:
        kernels = _GENERATED_KERNELS
    if lse_gemm and device.type == "cuda":
        kernels = dataclasses.replace(kernels, lse_gemm=logprob_gemm.statistics)
    return kernels
