"""Grouped-GEMM experts on the GPU: parity with per-expert matmuls and the time of one MoE expert block.

One Qwen3-30B-A3B expert block (hidden 2048, expert FFN 768, SwiGLU) over the routed tokens of an
8192-token micro-batch at top-8, forward and backward in bf16:
- `sequential`: what Megatron's SequentialMLP does (a host sync, then two matmuls per expert);
- `grouped`: `model/experts.grouped_linear` (torch._grouped_mm), weights stacked per call;
- `grouped_view`: the same with the experts' weights back to back in one buffer (a view, no copy);
- `grouped_fused`: `grouped_view` with the weight gradients added into back-to-back fp32 `main_grad`s,
  as under Megatron DDP with gradient-accumulation fusion.
Parity: the grouped outputs and gradients against an fp32 per-expert reference.

    python bench/gpu_moe_experts_check.py [--experts 128] [--tokens 8192] [--topk 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skyrl_megatron.model.moe.experts import grouped_linear  # noqa: E402


def routed_counts(tokens: int, experts: int, topk: int, skew: float, seed: int = 0) -> list[int]:
    """Tokens per expert for `tokens` tokens routed to `topk` distinct experts each (Zipf-like skew)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, experts + 1, dtype=torch.float64).pow(-skew)
    choices = torch.multinomial(weights.expand(tokens, -1), topk, generator=g)
    return torch.bincount(choices.flatten(), minlength=experts).tolist()


def block(x, counts, fc1, fc2, impl: str):
    if impl == "sequential":
        outs = []
        for rows, w1, w2 in zip(x.split(counts), fc1, fc2):
            gate, up = (rows @ w1.t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w2.t())
        return torch.cat(outs)
    fuse = impl == "grouped_fused"
    gate, up = grouped_linear(x, counts, fc1, fuse).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, counts, fc2, fuse)


def make_weights(experts, hidden, ffn, dtype, back_to_back: bool, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for rows, cols in ((2 * ffn, hidden), (hidden, ffn)):
        buffer = torch.randn(experts * rows * cols, device="cuda", generator=g, dtype=torch.float32).mul_(0.02).to(dtype)
        views = [buffer[i * rows * cols : (i + 1) * rows * cols].view(rows, cols) for i in range(experts)]
        params = [torch.nn.Parameter(v if back_to_back else v.clone()) for v in views]
        out.append(params)
    return out


def timed(fn, steps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of the routing (0: uniform)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    counts = routed_counts(args.tokens, args.experts, args.topk, args.skew)
    total = sum(counts)
    report = {"args": vars(args) | {"out": None}, "routed_rows": total, "max_rows_per_expert": max(counts),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # parity against an fp32 per-expert reference
    x = torch.randn(total, args.hidden, device="cuda").mul_(0.5)
    fc1, fc2 = make_weights(args.experts, args.hidden, args.ffn, torch.float32, True)
    ref_x = x.clone().requires_grad_()
    ref = block(ref_x, counts, fc1, fc2, "sequential")
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [ref_x, *fc1, *fc2], grad)
    bf1 = [torch.nn.Parameter(w.detach().bfloat16()) for w in fc1]
    bf2 = [torch.nn.Parameter(w.detach().bfloat16()) for w in fc2]
    bx = x.bfloat16().requires_grad_()
    out = block(bx, counts, bf1, bf2, "grouped")
    grads = torch.autograd.grad(out, [bx, *bf1, *bf2], grad.bfloat16())

    def rel(a, b):
        return float((a.detach().float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    report["parity_bf16_vs_fp32"] = {
        "output": rel(out, ref),
        "grad_input": rel(grads[0], ref_grads[0]),
        "grad_fc1_max": max(rel(a, b) for a, b in zip(grads[1 : 1 + args.experts], ref_grads[1 : 1 + args.experts]) if b.abs().sum() > 0),
        "grad_fc2_max": max(rel(a, b) for a, b in zip(grads[1 + args.experts :], ref_grads[1 + args.experts :]) if b.abs().sum() > 0),
    }
    del fc1, fc2, ref, ref_grads, out, grads

    timings = {}
    flops = 3 * 2 * total * args.hidden * 3 * args.ffn  # fwd + bwd (x3) of fc1 (2 ffn) and fc2 (1 ffn)
    for impl in ("sequential", "grouped", "grouped_view", "grouped_fused"):
        w1, w2 = make_weights(args.experts, args.hidden, args.ffn, torch.bfloat16, impl != "grouped")
        if impl == "grouped_fused":
            for ws in (w1, w2):  # back to back in one fp32 buffer, as Megatron DDP allocates them
                grads = torch.zeros(len(ws) * ws[0].numel(), device="cuda", dtype=torch.float32)
                for i, w in enumerate(ws):
                    w.main_grad = grads[i * w.numel() : (i + 1) * w.numel()].view(w.shape)
                    w.grad_added_to_main_grad = False
        xb = torch.randn(total, args.hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
        g = torch.randn(total, args.hidden, device="cuda", dtype=torch.bfloat16)

        def step():
            y = block(xb, counts, w1, w2, impl)
            y.backward(g)
            for w in (*w1, *w2):
                w.grad = None
            xb.grad = None

        seconds = timed(step)
        timings[impl] = {"ms": round(seconds * 1e3, 2), "tflops": round(flops / seconds / 1e12, 1)}
        print(f"{impl:14s} {seconds * 1e3:8.2f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s", flush=True)
        del w1, w2, xb, g
        torch.cuda.empty_cache()
    report["fwd_bwd"] = timings
    print(json.dumps({k: v for k, v in report.items() if k != "args"}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
