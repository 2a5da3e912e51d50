"""The MoE router's fp32 gating GEMM on one GPU: Megatron's upcast GEMM against cuBLAS's fp32-output bf16 GEMM.

`model/moe/router_gating.py` computes the router's logits from the bf16 hidden states and weight with fp32
accumulation and an fp32 output, where Megatron without Transformer Engine upcasts both operands and runs an fp32
GEMM. At a micro-batch of the MoE bench (default: 16,384 training tokens and 65,536 scoring tokens, hidden 2,048,
128 experts, top-8: Qwen3-30B-A3B's widths; `--hidden 4096` for Qwen3-235B-A22B's) this times the forward and the
forward + backward of both with CUDA events (median of `--repeats` after a warm-up), and reports how far the logits
differ (in units of the last place at their largest magnitude: the two orders of summation differ), how many
tokens' top-k expert sets differ, and whether the backward is bitwise Megatron's (it is the same computation). One
JSON line per token count.

    python bench/gpu_router_gating.py [--tokens 16384 65536 --hidden 2048 --experts 128 --topk 8]
"""

from __future__ import annotations

import argparse
import json

from cuda_timing import median_event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    from skyrl_megatron.model.moe import router_gating

    router_gating.install()
    assert router_gating._originals["te_missing"], "Transformer Engine is installed: Megatron already uses its GEMM"
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (0.02 * torch.randn(args.experts, args.hidden, device=device, generator=generator)).bfloat16()
    weight.requires_grad_()
    sides = {
        "megatron": lambda x: RouterGatingLinearFunction.apply(x, weight, None, torch.float32),
        "ours": lambda x: router_gating.router_gating_linear(x, weight, None, torch.float32),
    }
    for tokens in args.tokens:
        hidden = torch.randn(tokens, 1, args.hidden, device=device, generator=generator).bfloat16().requires_grad_()
        grad = torch.randn(tokens, 1, args.experts, device=device, generator=generator)
        row = {"tokens": tokens, "hidden": args.hidden, "experts": args.experts}
        results = {}
        for name, gate in sides.items():
            with torch.no_grad():
                row[f"{name}_forward_ms"] = round(median_event_ms(lambda: gate(hidden), args.repeats), 3)

            def forward_backward():
                hidden.grad = weight.grad = None
                gate(hidden).backward(grad)

            row[f"{name}_forward_backward_ms"] = round(median_event_ms(forward_backward, args.repeats), 3)
            hidden.grad = weight.grad = None
            logits = gate(hidden)
            logits.backward(grad)
            results[name] = (logits.detach(), hidden.grad.clone(), weight.grad.clone())
        (want, want_dx, want_dw), (got, got_dx, got_dw) = results["megatron"], results["ours"]
        assert got.dtype == torch.float32
        scale_ulp = torch.finfo(torch.float32).eps * float(want.abs().max())
        top_want = want.view(tokens, -1).topk(args.topk).indices.sort().values
        top_got = got.view(tokens, -1).topk(args.topk).indices.sort().values
        row.update({
            "largest_logit_difference_in_scale_ulps": round(float((want - got).abs().max()) / scale_ulp, 3),
            "tokens_with_other_topk": int((top_want != top_got).any(dim=-1).sum()),
            "backward_bitwise": bool(torch.equal(want_dx, got_dx) and torch.equal(want_dw, got_dw)),
        })
        print(json.dumps(row), flush=True)
        del hidden, grad, results, want, got


if __name__ == "__main__":
    main()
