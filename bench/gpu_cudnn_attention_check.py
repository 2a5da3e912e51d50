"""cuDNN ragged attention against FA2 varlen for packed causal micro-batches, on one GPU.

torch 2.11's `torch.nn.attention.varlen.varlen_attn` runs FA2 kernels: its cuDNN branch is switched
off (`_should_use_cudnn` returns False). The aten ops it would call, `_cudnn_attention_forward` and
`_cudnn_attention_backward`, take the same `cu_seqlens`. Before our core attention can offer them,
they must agree with FA2 on our micro-batches (values and gradients, GQA included) and be faster.
This script measures both on packed micro-batches shaped like the policy benchmark's (log-uniform
sequence lengths, 8,192 tokens, Qwen3-4B heads). Not a CI test: it needs CUDA and cuDNN.

Usage (on the GPU machine): python bench/gpu_cudnn_attention_check.py --out cudnn_attention.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from gpu_fusion_check import device_ms, run_with_grads  # same directory

HEADS, GROUPS, HEAD_DIM = 32, 8, 128


def packed_lengths(total: int, seed: int) -> list[int]:
    """Sequence lengths summing to `total`: prompts of ~256 tokens plus log-uniform responses."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        response = int(math.exp(torch.empty(1).uniform_(math.log(64), math.log(4096), generator=generator).item()))
        lengths.append(min(256 + response, total - sum(lengths)))
    return lengths


def flash(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))


class CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        result = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
        )
        out, lse, seed, offset = result[0], result[1], result[6], result[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, seed, offset,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def cudnn(q, k, v, cu, max_len, scale):
    return CudnnRagged.apply(q, k, v, cu, max_len, scale)


def reference(q, k, v, lengths, scale):
    """Per-sequence causal SDPA in fp32: the ground truth for both."""
    outputs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        out = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), k[rows].float().transpose(0, 1), v[rows].float().transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outputs)


def check(tokens: int, seed: int, groups: int) -> dict:
    torch.manual_seed(seed)
    lengths = packed_lengths(tokens, seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    max_len, scale = max(lengths), 1.0 / math.sqrt(HEAD_DIM)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, groups, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, groups, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q)
    # fp32 reference gradients through autograd on fp32 copies
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    truth = reference(*leaves, lengths, scale)
    truth.backward(grad.float())
    result = {"sequences": len(lengths), "max_len": max_len, "kv_heads": groups}
    for name, fn in (("flash", flash), ("cudnn", cudnn)):
        try:
            out, grads = run_with_grads(fn, [q, k, v], [cu, max_len, scale], grad)
            result[name] = {
                "max_error": (out.float() - truth.detach()).abs().max().item(),
                "max_grad_error": max((g.float() - l.grad).abs().max().item() for g, l in zip(grads, leaves)),
                "fwd_bwd_ms": device_ms(fn, [q, k, v], [cu, max_len, scale], grad),
            }
        except Exception as error:  # a backend that refuses these inputs is a finding, not a crash
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(name, json.dumps(result[name]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_cudnn_attention_check.json")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cases": [check(args.tokens, seed, groups) for seed in (0, 1) for groups in (GROUPS, HEADS)],
    }
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
