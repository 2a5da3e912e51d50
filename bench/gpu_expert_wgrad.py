"""The experts' weight gradients on one GPU: today's grouped GEMM plus an fp32 add, against one GEMM that adds.

Today (`model/moe/experts.py`) each expert's dW = dY_e^T X_e comes out of `torch._grouped_mm` in bf16 (it has no
fp32 output) and `grad_accumulate.accumulate_` adds it into DDP's fp32 `main_grad`: the GEMM writes E x out x in
bf16 values that the add reads back. quack's `gemm_add_inplace` with `cu_seqlens_k` (the experts' token counts as
the varying K; A = dY^T m-major, B = X n-major, both as they lie) accumulates into the fp32 buffer in its epilogue,
with the products summed in fp32 before the single rounding. This script times both at MoE shapes and compares each
with an fp64 reference per expert (the fused one must be no further from it than today's path), including experts
that receive no token. quack runs three ways: through `model/moe/expert_wgrad.py` (`quack_add`: the configuration
pinned for these widths on this GPU where `expert_wgrad.PINNED_CONFIGS` has one, else quack's default; the token total
changes every micro-batch, and the autotuner keys on shapes), with quack's default configuration (`quack_add_default`),
and autotuned at this shape (the best one configuration could do, with the configuration it chose: the one to pin; its
`first_call_s` is mostly the tuning, paid again for every new token total). It decides whether the experts' backward
should take quack where it is installed, and which configuration to pin.

    python bench/gpu_expert_wgrad.py [--tokens 16384 --topk 8 --experts 128 --hidden 2048 --ffn 768]
"""

from __future__ import annotations

import argparse
import json
import time

from cuda_timing import median_event_ms


def _offsets(tokens: int, topk: int, experts: int, empty: int, generator, device):
    import torch

    weights = torch.rand(experts, generator=generator, device=device) + 0.5
    weights[:empty] = 0.0  # the first `empty` experts get no token
    counts = torch.distributions.Multinomial(tokens * topk, probs=(weights / weights.sum()).cpu()).sample().long()
    return counts.cumsum(0).to(device=device, dtype=torch.int32)


def parse_layer_args(doc: str, untuned: bool = False) -> argparse.Namespace:
    """An MoE layer's widths and one micro-batch's routing (this script's and `gpu_expert_gemm.py`'s arguments);
    `untuned`: also the switch that leaves the autotuned GEMM out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--empty", type=int, default=3, help="experts that receive no token")
    parser.add_argument("--repeats", type=int, default=10)
    if untuned:
        parser.add_argument("--untuned", action="store_true", help="leave out the autotuned GEMM")
    return parser.parse_args()


def routed_rows(args: argparse.Namespace, device):
    """(offsets, cu_seqlens, rows): the experts' cumulative row ends as the grouped GEMM takes them, the same with a
    leading zero as quack takes them, and the rows in all; seeded, the first `--empty` experts without a token."""
    import torch

    from skyrl_megatron.model.quack_support import cu_seqlens

    torch.manual_seed(0)
    generator = torch.Generator(device=device).manual_seed(0)
    offsets = _offsets(args.tokens, args.topk, args.experts, args.empty, generator, device)
    return offsets, cu_seqlens(offsets), int(offsets[-1])


def quack_importable() -> bool:
    """Whether quack's GEMMs import here; prints the answer as the report's first line."""
    from skyrl_megatron.model import quack_support

    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as error:
        print(json.dumps({"quack": f"not importable: {error}"}))
        return False
    print(json.dumps({"quack": "importable", "missing_reason": quack_support.missing_reason(0)}))
    return True


def main() -> None:
    args = parse_layer_args(__doc__)

    import torch

    from skyrl_megatron.model.moe import expert_wgrad
    from skyrl_megatron.model.moe.grad_accumulate import accumulate_

    if not quack_importable():
        return
    from quack.gemm_interface import gemm_add_inplace

    device = torch.device("cuda")
    offsets, cu_seqlens, rows = routed_rows(args, device)
    # fc1 (gate and up: out 2 x ffn, in hidden) and fc2 (out hidden, in ffn), as the experts' two projections
    for name, out_features, in_features in (("fc1", 2 * args.ffn, args.hidden), ("fc2", args.hidden, args.ffn)):
        x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
        grad_output = torch.randn(rows, out_features, device=device, dtype=torch.bfloat16) * 0.01
        start_grad = torch.randn(args.experts, out_features, in_features, device=device) * 1e-3

        def today(target):
            accumulate_(target, torch._grouped_mm(grad_output.t(), x, offs=offsets))

        def fused(target):  # through the layer's own entry point
            expert_wgrad.add_(target, grad_output, x, offsets)

        def fused_default(target):
            gemm_add_inplace(grad_output.t(), x, target, cu_seqlens_k=cu_seqlens, tuned=False)

        def fused_tuned(target):
            gemm_add_inplace(grad_output.t(), x, target, cu_seqlens_k=cu_seqlens, tuned=True)

        results = {}
        ways = (("grouped_mm+add", today), ("quack_add", fused), ("quack_add_default", fused_default),
                ("quack_add_tuned", fused_tuned))
        for label, fn in ways:
            target = start_grad.clone()
            try:
                started = time.perf_counter()
                fn(target)
                torch.cuda.synchronize()
                first_call_s = time.perf_counter() - started
            except Exception as error:  # noqa: BLE001 - a kernel the library cannot build here: say so, go on
                results[label] = {"error": f"{type(error).__name__}: {error}"[:400]}
                continue
            torch.cuda.synchronize()
            errors = []
            for expert in range(args.experts):
                lo, hi = int(cu_seqlens[expert]), int(cu_seqlens[expert + 1])
                want = start_grad[expert].double() + grad_output[lo:hi].double().t() @ x[lo:hi].double()
                errors.append(((target[expert].double() - want).abs().max() / want.abs().max().clamp_min(1e-30)))
            scratch = start_grad.clone()
            ms = median_event_ms(lambda: fn(scratch), args.repeats)
            flops = 2 * rows * out_features * in_features
            results[label] = {"ms": round(ms, 3), "first_call_s": round(first_call_s, 2),
                              "tflops": round(flops / ms / 1e9, 1),
                              "max_rel_error": float(torch.stack(errors).max()),
                              "empty_experts_unchanged": bool(torch.equal(target[: args.empty], start_grad[: args.empty]))}
        if "ms" in results.get("quack_add_tuned", {}):  # the configuration the autotuner chose, to pin it by shape
            from quack.gemm_interface import gemm_tuned

            results["quack_add_tuned"]["config"] = str(getattr(gemm_tuned, "best_config", None))
        pinned = expert_wgrad.pinned_config(None, out_features, in_features)
        print(json.dumps({"projection": name, "experts": args.experts, "rows": rows, "out": out_features,
                          "in": in_features, "pinned": str(pinned), **results}))
        if "ms" in results.get("quack_add", {}) and "ms" in results["grouped_mm+add"]:
            today_error = results["grouped_mm+add"]["max_rel_error"]
            assert results["quack_add"]["max_rel_error"] <= today_error * 1.05 + 1e-6, results
            assert results["quack_add"]["empty_experts_unchanged"], results


if __name__ == "__main__":
    main()
