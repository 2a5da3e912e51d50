"""Core attention without Transformer Engine: torch SDPA and a segment kernel (flash-attn-4, torch's
`varlen_attn` or masked SDPA), with packed (THD) sequences and context parallelism (CP).

It takes the place of Megatron's local `DotProductAttention` (which materialises S x S scores and
supports neither THD nor CP) through the layer spec (:mod:`skyrl_megatron.model.layer_spec`), with the
same constructor and forward signature. The shapes are SelfAttention's contract:

* padded ("sbhd"): query [s, b, heads, d], key/value [s, b, groups, d] -> [s, b, heads * d];
* packed ("thd", `PackedSeqParams`): query [t, heads, d], key/value [t, groups, d] -> [t, heads * d].

Padded input without CP is one `scaled_dot_product_attention(is_causal=True)`. Everything else reduces
to one primitive, causal attention over *segments*, where segment i's queries are the last positions
of its keys (a bottom-right aligned causal mask, flash attention's convention when a query block is
shorter than its keys):

* packed sequences: one segment per sequence, queries and keys alike;
* context parallelism (the layout of :mod:`skyrl_megatron.model.layers.context_parallel_layout`: each
  sequence in 2*CP chunks, rank r holding chunks r and 2*CP-1-r): K and V are all-gathered over the CP
  group, and each of this rank's query chunks is a segment whose keys are its sequence's prefix up to
  the chunk's end.
  A padded batch under CP is the packed case with B sequences of length s * CP.

The segment kernel (:class:`~skyrl_megatron.attention_kernels.SegmentKernel`) is picked in one
place, :func:`select_segment_kernel`, from `megatron_config.attention_kernel` (default `auto`), the
runtime, the dtype, the GPU and what is installed:

* `flash4`: flash-attn-4's CuTe kernels (`flash_attn.cute`, an optional beta library compiled at first
  use): Hopper (sm90) and Blackwell (sm100) GPUs in bf16/fp16; `auto`'s choice there where installed;
* `varlen`: torch's `varlen_attn` (FlashAttention-2 kernels), any CUDA GPU in bf16/fp16; `auto`'s
  choice on other GPUs and where flash-attn-4 is not installed;
* `sdpa`: one SDPA call with a block-diagonal causal mask (exact; O(T^2) memory, meant for the CPU
  runtime and fp32 checks); `auto`'s choice on CPU and in fp32.

All three align a segment's causal mask bottom-right. A kernel asked for by name that cannot run here
is an error naming the key, never a quiet fallback.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from skyrl_megatron.attention_kernels import (
    ATTENTION_KERNELS,
    AUTO,
    FLASH4_COMPUTE_MAJORS,
    FLASH4_INSTALL_FIX,
    KEY,
    SegmentKernel,
    flash4_installed,
)
from skyrl_megatron.model.layers.context_parallel_layout import context_parallel_chunks, gathered_to_global_index
from skyrl_megatron.runtime import Runtime, current_runtime, quiet_megatron_import

with quiet_megatron_import():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import is_layer_window_attention

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class AttentionKernelError(ValueError):
    """The `attention_kernel` asked for cannot run here; the message names the key and the fix."""


@functools.lru_cache(maxsize=16)
def _compute_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _device_index(device: torch.device | None) -> int:
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def _flash4_obstacle(runtime: Runtime, dtype: torch.dtype, device: torch.device | None) -> tuple[str, str] | None:
    """Why flash-attn-4 cannot run here, and the fix; None when it can."""
    if runtime.is_cpu:
        return "flash-attn-4 runs on GPUs, and this worker runs the CPU runtime", f"set {KEY}=auto (masked SDPA on CPU)"
    if dtype not in _HALF_DTYPES:
        return f"flash-attn-4 runs in bf16/fp16, and the model computes in {dtype}", f"set trainer.bf16=true, or {KEY}=auto"
    if not flash4_installed():  # before any CUDA call: where it is missing, nothing asks the GPU
        return "flash-attn-4 (flash_attn.cute) is not installed", FLASH4_INSTALL_FIX
    major, minor = _compute_capability(_device_index(device))
    if major not in FLASH4_COMPUTE_MAJORS:
        name = torch.cuda.get_device_name(_device_index(device))
        problem = f"flash-attn-4 is used on Hopper (sm90) and Blackwell (sm100) GPUs; this one is sm{major}{minor} ({name})"
        return problem, f"set {KEY}=auto, or varlen"
    return None


def select_segment_kernel(
    runtime: Runtime, dtype: torch.dtype, setting: str = AUTO, device: torch.device | None = None
) -> SegmentKernel:
    """The one place that picks the segment kernel, for `megatron_config.attention_kernel` = `setting`.

    auto: flash-attn-4 where it can run (installed, sm90/sm100, bf16/fp16: checked against varlen_attn and
    fp32 in our module on an H200 by bench/gpu_fa4_check.py, and faster in whole steps, docs/performance.md),
    else `varlen_attn` on a GPU in bf16/fp16, else masked SDPA.
    """
    if setting not in ATTENTION_KERNELS:
        raise AttentionKernelError(f"{KEY}: unknown kernel {setting!r}. Fix: use one of {', '.join(ATTENTION_KERNELS)}.")
    if setting == SegmentKernel.MASKED_SDPA.value:
        return SegmentKernel.MASKED_SDPA
    gpu_half = not runtime.is_cpu and dtype in _HALF_DTYPES
    if setting == SegmentKernel.VARLEN.value:
        if not gpu_half:
            where = "the CPU runtime" if runtime.is_cpu else str(dtype)
            raise AttentionKernelError(f"{KEY}=varlen: varlen_attn runs on CUDA in bf16/fp16, not in {where}. "
                                       f"Fix: set {KEY}=auto.")
        return SegmentKernel.VARLEN
    obstacle = _flash4_obstacle(runtime, dtype, device)
    if setting == SegmentKernel.FLASH4.value:
        if obstacle is not None:
            raise AttentionKernelError(f"{KEY}=flash4: {obstacle[0]}. Fix: {obstacle[1]}.")
        return SegmentKernel.FLASH4
    if obstacle is None:
        return SegmentKernel.FLASH4
    return SegmentKernel.VARLEN if gpu_half else SegmentKernel.MASKED_SDPA


def flash4_passed_over(runtime: Runtime, dtype: torch.dtype, device: torch.device | None = None) -> str | None:
    """Why `attention_kernel: auto` does not take an installed flash-attn-4 here; None where it takes it or
    where flash-attn-4 is not installed (nothing to explain then)."""
    if not flash4_installed():
        return None
    obstacle = _flash4_obstacle(runtime, dtype, device)
    return None if obstacle is None else obstacle[0]


def describe_core_attention(runtime: Runtime, dtype: torch.dtype, setting: str = AUTO) -> str:
    """The log line's words for the kernels a model of `dtype` runs (raises where `setting` cannot run)."""
    kernel = select_segment_kernel(runtime, dtype, setting)
    passed_over = flash4_passed_over(runtime, dtype) if setting == AUTO and kernel is not SegmentKernel.FLASH4 else None
    note = f" (flash-attn-4 installed, not taken: {passed_over})" if passed_over else ""
    return f"torch SDPA (padded) / {kernel.label} (packed){note}, CP all-gather"


@dataclass(frozen=True)
class CausalSegments:
    """Causal attention over segments: queries q[cu_q[i]:cu_q[i+1]] are the last positions of keys
    k[cu_k[i]:cu_k[i+1]]."""

    cu_seqlens_q: Tensor  # int32 [n + 1]
    cu_seqlens_k: Tensor  # int32 [n + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    # rows of the given K/V that form the segments' keys, in order; None: K/V already are the segments
    key_index: Tensor | None = None


def _cumulative(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


@functools.lru_cache(maxsize=16)  # one entry per micro-batch layout, shared by all layers
def context_parallel_segments(
    seq_lengths: tuple[int, ...], cp_rank: int, cp_size: int, device: torch.device
) -> CausalSegments:
    """Segments for this CP rank's query chunks against K/V all-gathered (rank-major) over CP.

    Queries stay in local order (sequence by sequence, chunk r then chunk 2*CP-1-r), so the query
    segments are consecutive; each chunk's keys are its sequence's prefix up to the chunk's end.
    """
    rows_of_global = gathered_to_global_index(seq_lengths, cp_size)
    q_lengths, k_lengths, key_rows = [], [], []
    start = 0
    for length in seq_lengths:
        chunk = length // (2 * cp_size)
        for index in context_parallel_chunks(cp_rank, cp_size):
            q_lengths.append(chunk)
            k_lengths.append((index + 1) * chunk)
            key_rows.append(rows_of_global[start : start + (index + 1) * chunk])
        start += length
    return CausalSegments(
        cu_seqlens_q=_cumulative(q_lengths, device),
        cu_seqlens_k=_cumulative(k_lengths, device),
        max_seqlen_q=max(q_lengths),
        max_seqlen_k=max(k_lengths),
        key_index=torch.cat(key_rows).to(device),
    )


class _SequenceLengthsOnHost:
    """The packed sequence lengths of the micro-batch being run, read from its boundaries once.

    Every layer passes the same boundary tensor (the micro-batch's, on the GPU); reading it back is a
    device-to-host wait, which once per layer would drain the GPU's queue in every layer. The entry is
    held, so its identity cannot pass to another tensor while cached."""

    def __init__(self):
        self._boundaries: Tensor | None = None
        self._lengths: tuple[int, ...] = ()

    def of(self, cu_seqlens: Tensor) -> tuple[int, ...]:
        if cu_seqlens is not self._boundaries:
            self._boundaries, self._lengths = cu_seqlens, tuple(cu_seqlens.diff().tolist())
        return self._lengths


_SEQUENCE_LENGTHS = _SequenceLengthsOnHost()


def segment_causal_mask(segments: CausalSegments) -> Tensor:
    """[Tq, Tk] bool, True where a query may attend: same segment, key not after the query."""
    cu_q, cu_k = segments.cu_seqlens_q.long(), segments.cu_seqlens_k.long()
    q_lengths, k_lengths = cu_q.diff(), cu_k.diff()
    segment_ids = torch.arange(q_lengths.numel(), device=cu_q.device)
    q_segment = segment_ids.repeat_interleave(q_lengths)
    k_segment = segment_ids.repeat_interleave(k_lengths)
    # a query's position among its segment's keys (bottom-right alignment), and each key's position
    q_position = torch.arange(q_segment.numel(), device=cu_q.device) - cu_q[q_segment]
    q_position += (k_lengths - q_lengths)[q_segment]
    k_position = torch.arange(k_segment.numel(), device=cu_k.device) - cu_k[k_segment]
    return (q_segment[:, None] == k_segment[None, :]) & (k_position[None, :] <= q_position[:, None])


@functools.lru_cache(maxsize=1)
def _flash4_varlen():
    """flash-attn-4's varlen entry, imported once (at model build: its CuTe DSL takes a few seconds)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        # `auto` comes here too: the fix names the kernel that needs no flash-attn-4
        raise AttentionKernelError(f"{KEY}: flash-attn-4 is installed but `from flash_attn.cute import "
                                   f"flash_attn_varlen_func` failed ({exc}). Fix: reinstall it "
                                   f"(pip install flash-attn-4), or set {KEY}=varlen.") from exc
    return flash_attn_varlen_func


def _flash4_segments(query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments, scale: float) -> Tensor:
    # flash-attn-4 aligns its causal mask bottom-right when queries are fewer than keys, as segments require.
    # The value arrives as a view into the fused QKV projection (rows (heads per group + 2) x groups x dim apart):
    # the kernels' backward reads it 9% slower than a contiguous copy costs (bench/gpu_fa4_layout.py, H200).
    result = _flash4_varlen()(
        query,
        key,
        value.contiguous(),
        cu_seqlens_q=segments.cu_seqlens_q,
        cu_seqlens_k=segments.cu_seqlens_k,
        max_seqlen_q=segments.max_seqlen_q,
        max_seqlen_k=segments.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
    )
    return result[0] if isinstance(result, tuple) else result  # (out, lse) in some releases


def _varlen_segments(query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments, scale: float) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    # window (-1, 0) is varlen_attn's causal mode; flash aligns it bottom-right, as segments require
    return varlen_attn(
        query,
        key,
        value,
        segments.cu_seqlens_q,
        segments.cu_seqlens_k,
        segments.max_seqlen_q,
        segments.max_seqlen_k,
        scale=scale,
        window_size=(-1, 0),
    )


def _masked_sdpa_segments(query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments, scale: float) -> Tensor:
    output = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        attn_mask=segment_causal_mask(segments),
        scale=scale,
        enable_gqa=True,
    )
    return output.squeeze(0).transpose(0, 1)


_SEGMENT_KERNELS = {
    SegmentKernel.FLASH4: _flash4_segments,
    SegmentKernel.VARLEN: _varlen_segments,
    SegmentKernel.MASKED_SDPA: _masked_sdpa_segments,
}


def attend_segments(
    query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments, scale: float, kernel: SegmentKernel
) -> Tensor:
    """Causal attention over segments. query [Tq, heads, d], key/value [Tk, groups, d] -> [Tq, heads, d]."""
    if segments.key_index is not None:
        key = key.index_select(0, segments.key_index)
        value = value.index_select(0, segments.key_index)
    return _SEGMENT_KERNELS[kernel](query, key, value, segments, scale)


def _sbhd_to_bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd_to_thd(x: Tensor) -> Tensor:
    """[s, b, heads, d] -> [b * s, heads, d]: the rows of a padded batch laid end to end."""
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _all_gather_over_context_parallel(tensor: Tensor, group) -> Tensor:
    # Megatron's dim-0 all-gather whose backward reduce-scatters: every rank's queries read the
    # gathered K/V, so the gradient of a rank's local K/V is the sum over all CP ranks.
    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group)


class CoreAttention(MegatronModule):
    """Causal self-attention core: SDPA (padded) / a segment kernel (packed), CP by K/V all-gather.

    `attention_kernel` is `megatron_config.attention_kernel` (the layer spec binds it)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        attention_kernel: str = AUTO,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            f"attention_type {attention_type!r} (self-attention only)": attention_type != "self",
            f"attn_mask_type {attn_mask_type.name} (causal only)": attn_mask_type != AttnMaskType.causal,
            f"attention dropout {dropout} (RL fine-tuning runs without dropout)": dropout > 0,
            f"softmax_type {config.softmax_type!r}": config.softmax_type != "vanilla",
            "sliding-window attention": is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, layer_number
            ),
            "qk_clip / log_max_attention_logit": config.qk_clip or config.log_max_attention_logit,
            f"cp_comm_type {cp_comm_type!r} (K/V all-gather only)": cp_comm_type not in (None, "all_gather"),
        }
        problems = [name for name, present in unsupported.items() if present]
        if problems:
            raise NotImplementedError(
                f"skyrl-megatron core attention does not support: {', '.join(problems)}. "
                "Install Transformer Engine for these features."
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and multiplies
        # it back inside its fp16 softmax (an overflow guard); with SDPA's fp32 softmax the net scale is
        # the plain one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.runtime = current_runtime()
        self.attention_kernel = attention_kernel
        self._kernels: dict[tuple[torch.dtype, torch.device], SegmentKernel] = {}
        # chosen (and refused, where it cannot run) at model build, for the model's dtype on this device
        self.segment_kernel = self._segment_kernel(config.params_dtype, self.runtime.torch_device)
        if self.segment_kernel is SegmentKernel.FLASH4:
            _flash4_varlen()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None or attention_bias is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                "skyrl-megatron core attention computes causal attention only: pass attention_mask=None "
                "and pack padded batches (skyrl_megatron.compute.microbatch.pack) instead of masking them"
            )
        if packed_seq_params is None:
            return self._padded(query, key, value)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"packed qkv_format {packed_seq_params.qkv_format!r} (only 'thd')")
        return self._packed(query, key, value, packed_seq_params)

    def _padded(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        seq, batch = query.shape[:2]
        if self.cp_size == 1:
            output = F.scaled_dot_product_attention(
                _sbhd_to_bhsd(query),
                _sbhd_to_bhsd(key),
                _sbhd_to_bhsd(value),
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
            return output.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        # each row is one sequence of length seq * CP: the packed case on [b * s, heads, d]
        output = self._context_parallel(
            _sbhd_to_thd(query), _sbhd_to_thd(key), _sbhd_to_thd(value), (seq * self.cp_size,) * batch
        )
        return output.reshape(batch, seq, -1).transpose(0, 1).contiguous()

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        # the padded boundaries define where tokens sit (Megatron's RoPE reads them the same way);
        # self-attention: the key boundaries are the query boundaries
        cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if self.cp_size == 1:
            max_seqlen = params.max_seqlen_q or int(cu_seqlens.diff().max())
            segments = CausalSegments(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
            output = attend_segments(query, key, value, segments, self.softmax_scale, self._kernel(query))
        else:
            output = self._context_parallel(query, key, value, _SEQUENCE_LENGTHS.of(cu_seqlens))
        return output.reshape(output.shape[0], -1)

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, seq_lengths: tuple[int, ...]) -> Tensor:
        key = _all_gather_over_context_parallel(key, self.cp_group)
        value = _all_gather_over_context_parallel(value, self.cp_group)
        segments = context_parallel_segments(seq_lengths, self.cp_group.rank(), self.cp_size, query.device)
        return attend_segments(query, key, value, segments, self.softmax_scale, self._kernel(query))

    def _kernel(self, query: Tensor) -> SegmentKernel:
        return self._segment_kernel(query.dtype, query.device)

    def _segment_kernel(self, dtype: torch.dtype, device: torch.device) -> SegmentKernel:
        # decided once per dtype and device: the decision reads the GPU and looks for flash-attn-4
        if (dtype, device) not in self._kernels:
            self._kernels[dtype, device] = select_segment_kernel(self.runtime, dtype, self.attention_kernel, device)
        return self._kernels[dtype, device]
