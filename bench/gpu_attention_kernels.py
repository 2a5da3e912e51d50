"""Packed causal attention kernels on one GPU: flash-attn-4's CuTe kernels against the model's path (issue 18).

The model's packed attention (`model/attention.attend_segments`, flash=True) runs torch 2.11's
`varlen_attn`, FlashAttention-2 kernels. flash-attn-4 (`flash_attn.cute`, CuTe DSL, JIT-compiled)
ships Hopper kernels (`flash_fwd_sm90`, `flash_bwd_sm90`) of the FA3 design (warp-specialised,
TMA, asynchronous wgmma). This script measures, on the RL batch's packed shapes, whether they are
faster than what the model runs today and whether they are as exact, before any model code uses them:

- exactness: output and dq, dk, dv of each kernel (bf16) against an fp32 reference (per-sequence
  causal SDPA in fp32 on the same inputs); the report gives each kernel's max and mean error;
- speed: forward and forward + backward milliseconds (CUDA events, median of `--repeat` after
  warm-up), and the achieved TFLOP/s (causal: 2 * 2 * sum(s^2) / 2 * heads * d forward, 2.5x that
  for the backward);
- the first call's seconds (the CuTe kernels compile on first use of a shape class).

Shapes: Qwen3-1.7B (16 query heads, 8 key/value heads) and Qwen3-4B (32 / 8), head dim 128,
sequences of 256-4096 tokens (log-uniform, seeded) packed to `--tokens` per micro-batch, as
`bench/policy_bench.py` packs its RL batch at 8192.

    python bench/gpu_attention_kernels.py --out $OUT/attention.json [--tokens 8192] [--repeat 20]
    python bench/gpu_attention_kernels.py --smoke --out /tmp/a.json   # CPU: batch, reference, report only

flash-attn-4 comes from `bench/device_setup.sh 3` and `4` (its wheels and the CuTe DSL's, about
100 MB, in two calls); where it is not importable its rows say why.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_megatron.model.attention import CausalSegments, attend_segments  # noqa: E402

SHAPES = {"Qwen3-1.7B": (16, 8, 128), "Qwen3-4B": (32, 8, 128)}  # query heads, key/value heads, head dim
SMOKE_SHAPES = {"tiny": (4, 2, 16)}


def packed_lengths(tokens: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Sequence lengths, log-uniform in [shortest, longest], filling exactly `tokens`."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        length = int(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
        lengths.append(min(length, tokens - sum(lengths)))
    return lengths


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention: QK^T and PV, half the square each."""
    return sum(2 * 2 * s * s / 2 * heads * head_dim for s in lengths)


def reference(q, k, v, lengths: list[int], scale: float, grad_out):
    """fp32 per-sequence causal SDPA: the output and the gradients of q, k, v."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    outputs, start = [], 0
    for s in lengths:
        def bhsd(t):
            return t[start : start + s].transpose(0, 1).unsqueeze(0)

        out = F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
        start += s
    out = torch.cat(outputs)
    out.backward(grad_out.float())
    return out.detach(), q.grad, k.grad, v.grad


def torch_varlen(q, k, v, cu, max_len: int, scale: float):
    """The model's path: `attend_segments` with flash (torch's varlen_attn, FA2 kernels)."""
    return attend_segments(q, k, v, CausalSegments(cu, cu, max_len, max_len), scale, flash=True)


def flash_attn_4(q, k, v, cu, max_len: int, scale: float):
    from flash_attn.cute import flash_attn_varlen_func

    result = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                    max_seqlen_k=max_len, softmax_scale=scale, causal=True)
    return result[0] if isinstance(result, tuple) else result


def masked_sdpa(q, k, v, cu, max_len: int, scale: float):
    """The CPU path of the model (one SDPA call with a segment mask): what --smoke runs."""
    return attend_segments(q, k, v, CausalSegments(cu, cu, max_len, max_len), scale, flash=False)


def _errors(got, want) -> dict[str, float]:
    diff = (got.float() - want).abs()
    return {"max": diff.max().item(), "mean": diff.mean().item()}


def _time_ms(fn, repeat: int, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) / repeat * 1e3
    times = []
    for _ in range(repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def measure(kernel, q, k, v, cu, max_len, scale, grad_out, want, repeat, device) -> dict:
    """One kernel on one shape: first-call seconds, errors against the fp32 reference, timings."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def forward():
        return kernel(q, k, v, cu, max_len, scale)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        forward().backward(grad_out)

    begin = time.perf_counter()
    out = forward()
    out.backward(grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - begin
    errors = {name: _errors(got, ref) for name, got, ref in
              zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), want)}
    for _ in range(3):  # warm-up
        forward_backward()
    with torch.no_grad():
        forward_ms = _time_ms(forward, repeat, device)
    step_ms = _time_ms(forward_backward, repeat, device)
    return {"first_call_s": first_call_s, "errors": errors, "forward_ms": forward_ms, "forward_backward_ms": step_ms}


def run(shapes: dict, tokens: int, shortest: int, longest: int, repeat: int, device: torch.device,
        kernels: dict) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = packed_lengths(tokens, shortest, longest)
    cu = torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "tokens": tokens, "sequences": len(lengths), "longest": max(lengths), "shapes": {}}
    for name, (heads, groups, head_dim) in shapes.items():
        torch.manual_seed(0)
        q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(tokens, groups, head_dim, device=device, dtype=dtype)
        v = torch.randn(tokens, groups, head_dim, device=device, dtype=dtype)
        grad_out = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
        scale = head_dim**-0.5
        want = reference(q, k, v, lengths, scale, grad_out)
        flops = causal_flops(lengths, heads, head_dim)
        rows = {}
        for label, kernel in kernels.items():
            try:
                row = measure(kernel, q, k, v, cu, max(lengths), scale, grad_out, want, repeat, device)
            except Exception as error:  # noqa: BLE001 -- a kernel that cannot run here is reported, not fatal
                rows[label] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
                continue
            row["forward_tflops"] = flops / row["forward_ms"] / 1e9
            row["forward_backward_tflops"] = 3.5 * flops / row["forward_backward_ms"] / 1e9
            rows[label] = row
        report["shapes"][name] = {"heads": heads, "kv_heads": groups, "head_dim": head_dim, "kernels": rows}
    return report


def table(report: dict) -> str:
    lines = [f"{report['device']}, torch {report['torch']}: {report['tokens']} tokens packed as "
             f"{report['sequences']} sequences (longest {report['longest']})",
             "| shape | kernel | forward ms (TFLOP/s) | fwd+bwd ms (TFLOP/s) | max err out / dq / dk / dv | first call s |",
             "|---|---|---|---|---|---|"]
    for shape, entry in report["shapes"].items():
        for label, row in entry["kernels"].items():
            if "error" in row:
                lines.append(f"| {shape} | {label} | {row['error']} | | | |")
                continue
            errs = " / ".join(f"{row['errors'][n]['max']:.1e}" for n in ("out", "dq", "dk", "dv"))
            lines.append(f"| {shape} | {label} | {row['forward_ms']:.2f} ({row['forward_tflops']:.0f}) | "
                         f"{row['forward_backward_ms']:.2f} ({row['forward_backward_tflops']:.0f}) | {errs} | "
                         f"{row['first_call_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shortest", type=int, default=256)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU: the model's masked SDPA path, tiny shapes")
    args = parser.parse_args(argv)
    if args.smoke:
        report = run(SMOKE_SHAPES, min(args.tokens, 96), 8, 40, 2, torch.device("cpu"), {"masked SDPA (CPU path)": masked_sdpa})
    else:
        report = run(SHAPES, args.tokens, args.shortest, args.longest, args.repeat, torch.device("cuda"),
                     {"torch varlen_attn (FA2, the model's path)": torch_varlen, "flash-attn-4 CuTe (sm90)": flash_attn_4})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
