"""Query/key RMSNorm and rotary embedding as one operation (`fused_kernels: [qk_norm_rope]`).

Qwen3 normalises each attention head of the query and key (RMSNorm over 128-wide rows) and then
rotates them. Without Transformer Engine, Megatron-Core runs the two apart: PyTorch's fused RMSNorm,
which launches a thread block per 128-wide row and reduces the weight gradient in two more kernels,
then the rotation (`rope.py`). In a profiled Qwen3-4B step on an H200 the RMSNorms (these and the
block's own) took about 0.59 s of 4.75 s of kernels (profiled 2026-11-27). Here the norm and the rotation
are one kernel per direction, in fp32, rounded once, and the rotation's call is the only call per tensor
and direction: the generated RMSNorm (`fused_kernels: [rms_norm]`) was a loss because it added compiled
calls, each with its host cost (`docs/performance.md`).

On GPU the kernels are Triton's (`norm_rope_kernels.py`: one read of the inputs per direction, the weight
gradient summed per program); the functions below are their reference and run on CPU.

`QKNormRopeSelfAttention` is Megatron's `SelfAttention` with the two steps joined where they can be:
packed (THD) micro-batches, full-width rotate-half RoPE, no inference context. Anywhere else it runs
Megatron's own path unchanged, norms included.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor

from skyrl_megatron.model.layers import rope
from skyrl_megatron.model.layers.norm import DeferrableRMSNorm, deferred


def _rotate_half_transposed(t: Tensor) -> Tensor:
    """The adjoint of rotate-half ((a, b) -> (-b, a), `rope.rotate_half_rope`): (a, b) -> (b, -a)."""
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat((second, -first), dim=-1)


def norm_rope_forward(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RoPE(RMSNorm(x) * weight) in x's dtype, 1/rms per row in fp32) for x [tokens, *heads, dim] and
    cos/sin [tokens, 1, ..., 1, dim] (rotate-half layout, one 1 per head dimension of x)."""
    x32 = x.float()
    inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32 * inverse_rms * weight.float()
    return rope.rotate_half_rope(normed, cos, sin).to(x.dtype), inverse_rms  # rotated in fp32


def norm_rope_backward(grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
                       inverse_rms: Tensor) -> tuple[Tensor, Tensor]:
    """(the gradient of x in x's dtype, fp32 terms [tokens, dim] whose sum over the first dimension is the
    weight's gradient: each element's product, summed over the head dimensions)."""
    grad32 = grad.float()
    grad_normed = grad32 * cos.float() + _rotate_half_transposed(grad32 * sin.float())
    x_hat = x.float() * inverse_rms
    grad_x_hat = grad_normed * weight.float()
    grad_x = inverse_rms * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), (grad_normed * x_hat).sum(dim=tuple(range(1, x.dim() - 1)))


def _kernels(device: torch.device):
    """Triton's kernels on GPU; the reference functions on CPU."""
    if device.type == "cuda":
        from skyrl_megatron.model.layers import norm_rope_kernels

        return norm_rope_kernels.norm_rope_forward, norm_rope_kernels.norm_rope_backward
    return norm_rope_forward, norm_rope_backward


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
        forward_kernel, ctx.backward_kernel = _kernels(x.device)  # a pair: they share 1/rms's layout
        out, inverse_rms = forward_kernel(x, weight, cos, sin, eps)
        ctx.save_for_backward(x, weight, cos, sin, inverse_rms)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, cos, sin, inverse_rms = ctx.saved_tensors
        grad_x, weight_sums = ctx.backward_kernel(grad.contiguous(), x, weight, cos, sin, inverse_rms)
        grad_weight = weight_sums.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None, None, None


def norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """RMSNorm (per row of x's last dimension, scaled by `weight`) then rotate-half RoPE, one kernel
    per direction. x [tokens, *heads, dim], read where it lies (a view into the fused QKV projection's
    output: its rows must be contiguous); cos/sin [tokens, 1, dim]. Returns a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    broadcast = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    return _NormRope.apply(x, weight, cos.reshape(broadcast), sin.reshape(broadcast), eps)


class QKNormRopeSelfAttention(SelfAttention):
    """Megatron's `SelfAttention` whose query/key norms and rotation run as `norm_rope` on packed
    micro-batches. Megatron's `forward` runs as it is, given no rotary embedding (so it rotates
    nothing); the split into query, key and value returns them normalised and rotated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rotation = None  # (query's and key's frequency tables, packed_seq_params) inside forward

    def forward(self, hidden_states: Tensor, attention_mask: Tensor, *args, **kwargs):
        rotary = kwargs.get("rotary_pos_emb")
        pair = rotary if rotary is None or isinstance(rotary, tuple) else (rotary, rotary)  # query's, key's
        if args or not self._joinable(pair, kwargs.get("packed_seq_params"), kwargs.get("inference_context")):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._rotation = (pair, kwargs["packed_seq_params"])
        try:
            return super().forward(hidden_states, attention_mask, *args, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rotation = None

    def _joinable(self, pair, packed_seq_params, inference_context) -> bool:
        config = self.config
        if pair is None or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return False
        if inference_context is not None or config.rotary_interleaved or config.multi_latent_attention:
            return False
        full_width = all(freqs is not None and freqs.shape[-1] == self.hidden_size_per_attention_head for freqs in pair)
        norms = (self.q_layernorm, self.k_layernorm)
        return full_width and all(isinstance(norm, DeferrableRMSNorm) for norm in norms)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self._rotation is None or not split_qkv:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        (q_freqs, k_freqs), params = self._rotation
        if output_gate or self.config.num_query_groups < self.world_size:
            # Megatron's split (gated query, or query heads picked out of a gathered group) then the kernels
            with deferred(self.q_layernorm, self.k_layernorm):
                query, key, *rest = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate)
            query = self._norm_rope(query, self.q_layernorm, q_freqs, _boundaries(params, "q"))
            key = self._norm_rope(key, self.k_layernorm, k_freqs, _boundaries(params, "kv"))
            return (query, key, *rest)
        # The kernels read query and key inside the projection's output [sq, b, groups, (q + 2) * dim]:
        # Megatron's reshape of query to [sq, b, heads, dim] copies it, and key's view would be copied to be
        # contiguous; together 648 copies and 34 ms of a Qwen3-4B training call on an H200 (profiled 2026-11-28).
        mixed_qkv, sizes = super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=False)
        query, key, value = torch.split(mixed_qkv, sizes, dim=3)  # one cat in backward, as Megatron's
        dim = self.hidden_size_per_attention_head
        grouped_query = query.unflatten(-1, (-1, dim))  # [sq, b, groups, heads per group, dim], a view
        query = self._norm_rope(grouped_query, self.q_layernorm, q_freqs, _boundaries(params, "q"))
        key = self._norm_rope(key, self.k_layernorm, k_freqs, _boundaries(params, "kv"))
        return query.flatten(2, 3), key, value

    def _norm_rope(self, t: Tensor, norm: DeferrableRMSNorm, freqs: Tensor, cu_seqlens: Tensor) -> Tensor:
        """`t` [tokens, 1, *heads, dim] normalised and rotated as Megatron would, one kernel per direction."""
        cp = self.pg_collection.cp
        cos, sin = rope.rotation_tables(freqs, cu_seqlens, t.shape[0], cp.size(), cp.rank(), t.dtype,
                                        self._yarn_concentration_factor)
        eps = norm.eps if norm.eps is not None else torch.finfo(t.dtype).eps
        return norm_rope(t.squeeze(1), norm.weight, cos.squeeze(1), sin.squeeze(1), eps).unsqueeze(1)


def _boundaries(params, side: str) -> Tensor:
    """The packed boundaries Megatron's rotation reads: the padded ones where the micro-batch has them."""
    padded = getattr(params, f"cu_seqlens_{side}_padded", None)
    return padded if padded is not None else getattr(params, f"cu_seqlens_{side}")
