"""Packed causal attention kernels against FA2 varlen on our micro-batches, on one GPU.

torch 2.11's `torch.nn.attention.varlen.varlen_attn` (the model's packed path) runs FA2 kernels. Two
candidates must agree with it on our micro-batches (values and gradients against an fp32 reference,
GQA included) and be faster before our core attention can offer them:
- cuDNN ragged attention (`cudnn`, session 8): its cuDNN branch is switched off
  (`_should_use_cudnn` returns False); the aten ops it would call, `_cudnn_attention_forward` and
  `_cudnn_attention_backward`, take the same `cu_seqlens`.
- flash-attn-4's CuTe kernels (`fa4`, session 15): `flash_attn.cute` ships Hopper kernels of the FA3
  design (`flash_fwd_sm90`, `flash_bwd_sm90`), compiled at first use; `bench/device_setup.sh` parts 3-4
  install it. Prediction in docs/perf_notes.md.
This script measures them on packed micro-batches shaped like the policy benchmark's (log-uniform
sequence lengths, 8,192 tokens, Qwen3-4B heads): errors, forward and forward + backward milliseconds,
and the first call on new shapes. Not a CI test: it needs CUDA.

Usage (on the GPU machine): python bench/gpu_cudnn_attention_check.py --out attention.json [--kernels flash,fa4]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

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


def flash(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


class CudnnRagged(torch.autograd.Function):
    """The two aten ops behind SDPA's cuDNN backend, called with cumulative sequence lengths."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # returns (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
        result = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False, scale=scale
        )
        out, lse, seed, offset = result[0], result[1], result[6], result[7]
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        # schema order: grad, q, k, v, out, lse, seed, offset, bias, cu_q, cu_k, max_q, max_k, dropout, causal
        # (torch 2.11's own disabled cuDNN branch of varlen_attn passes them in another order)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None, None, None


def cudnn(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return CudnnRagged.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def reference(q, k, v, q_lengths, k_lengths, scale):
    """Per-segment causal attention in fp32, bottom-right aligned (a segment's queries are the last
    positions of its keys): the ground truth for both kernels."""
    outputs, q_start, k_start = [], 0, 0
    for q_len, k_len in zip(q_lengths, k_lengths):
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        out = F.scaled_dot_product_attention(
            *(x.float().transpose(0, 1) for x in (q[q_start : q_start + q_len], k[k_start : k_start + k_len],
                                                    v[k_start : k_start + k_len])),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
        q_start, k_start = q_start + q_len, k_start + k_len
    return torch.cat(outputs)


def flash_attn_4(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from flash_attn.cute import flash_attn_varlen_func

    result = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                    max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return result[0] if isinstance(result, tuple) else result  # (out, lse) where it returns both


def cumulative(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


KERNELS = {
    "flash": lambda q, k, v, cu_q, cu_k, max_q, max_k, budget, scale: flash(q, k, v, cu_q, cu_k, max_q, max_k, scale),
    "cudnn": lambda q, k, v, cu_q, cu_k, max_q, max_k, budget, scale: cudnn(q, k, v, cu_q, cu_k, max_q, max_k, scale),
    # the same with the maximum length fixed at the token budget: one cuDNN graph for every micro-batch?
    "cudnn_fixed_max": lambda q, k, v, cu_q, cu_k, max_q, max_k, budget, scale: cudnn(
        q, k, v, cu_q, cu_k, budget, budget, scale
    ),
    "fa4": lambda q, k, v, cu_q, cu_k, max_q, max_k, budget, scale: flash_attn_4(q, k, v, cu_q, cu_k, max_q, max_k, scale),
}


def forward_ms(fn, inputs, constants, repeats: int = 20) -> float:
    """Median device time of the forward alone, without autograd (the scoring pass)."""
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs, *constants)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs, *constants)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(tokens: int, seed: int, groups: int, kernels: list[str], query_fraction: int = 1) -> dict:
    """One packed micro-batch; query_fraction 2 keeps each segment's last half of queries (the
    shape of our context-parallel segments, where alignment matters)."""
    torch.manual_seed(seed)
    k_lengths = packed_lengths(tokens, seed)
    q_lengths = [max(1, length // query_fraction) for length in k_lengths]
    cu_q, cu_k = cumulative(q_lengths), cumulative(k_lengths)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    q = torch.randn(sum(q_lengths), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, groups, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, groups, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q)
    # fp32 reference gradients through autograd on fp32 copies
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    truth = reference(*leaves, q_lengths, k_lengths, scale)
    truth.backward(grad.float())
    constants = [cu_q, cu_k, max(q_lengths), max(k_lengths), tokens, scale]
    result = {"sequences": len(k_lengths), "max_len": max(k_lengths), "kv_heads": groups,
              "query_fraction": query_fraction}
    for name in kernels:
        fn = KERNELS[name]
        try:
            out, grads = run_with_grads(fn, [q, k, v], constants, grad)
            result[name] = {
                "max_error": (out.float() - truth.detach()).abs().max().item(),
                "max_grad_error": max((g.float() - l.grad).abs().max().item() for g, l in zip(grads, leaves)),
                "fwd_ms": forward_ms(fn, [q, k, v], constants),
                "fwd_bwd_ms": device_ms(fn, [q, k, v], constants, grad),
            }
        except Exception as error:  # a backend that refuses these inputs is a finding, not a crash
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(name, json.dumps(result[name]), flush=True)
    return result


def first_call_ms(tokens: int, seeds: range, kernels: list[str]) -> dict:
    """Wall time of the first forward + backward on micro-batches of new shapes (new sequence
    lengths and counts, as every RL step brings): cuDNN builds an execution graph per new shape,
    FA2 has nothing to build. The second call on the same shape is the warm time."""
    scale = 1.0 / math.sqrt(HEAD_DIM)
    report = {}
    for name in kernels:
        fn = KERNELS[name]
        times = []
        for seed in seeds:
            lengths = packed_lengths(tokens - 8 * seed, seed)  # a different total as well
            total, cu = sum(lengths), cumulative(lengths)
            leaves = [torch.randn(total, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()
                      for h in (HEADS, GROUPS, GROUPS)]
            grad = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            pair = []
            for _ in range(2):
                torch.cuda.synchronize()
                begin = time.perf_counter()
                fn(*leaves, cu, cu, max(lengths), max(lengths), tokens, scale).backward(grad)
                torch.cuda.synchronize()
                pair.append(round((time.perf_counter() - begin) * 1e3, 2))
            times.append({"sequences": len(lengths), "first_ms": pair[0], "second_ms": pair[1]})
        report[name] = times
        print("first call", name, json.dumps(times), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_cudnn_attention_check.json")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cases": [check(args.tokens, seed, groups, kernels) for seed in (0, 1) for groups in (GROUPS, HEADS)],
        "segment_cases": [check(args.tokens, 2, GROUPS, kernels, query_fraction=2)],
    }
    report["first_call"] = first_call_ms(args.tokens, range(10, 16), kernels)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
