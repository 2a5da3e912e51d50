"""The experts' forward and input-gradient GEMMs on one GPU: `torch._grouped_mm` against quack's varlen-M GEMM.

The forward Y_e = X_e W_e^T and the input gradient dX_e = dY_e W_e of both projections (fc1: in hidden, out 2 x
ffn; fc2: in ffn, out hidden), rows grouped by expert with some experts receiving none, as `model/moe/experts.py`
calls `torch._grouped_mm` (the stacked [E, out, in] weight, transposed as a view for the forward). quack's `gemm`
takes the same operands with the experts' row counts as the varying M (`cu_seqlens_m`): at its default
configuration through `model/moe/expert_gemm.py` (what `moe_config.expert_gemms` auto runs on such a GPU, for every token total)
and autotuned at this shape (the best one configuration does; its `first_call_s` is mostly the tuning, and the
autotuner keys on shapes, so every new token total would tune again). Errors: the largest relative error of an
expert's output against fp64. The weight gradients are `bench/gpu_expert_wgrad.py`'s; together they decided that
the experts' GEMMs take quack where it is installed (on 2026-12-06 its tuned varlen-K GEMM ran the weight
gradients at 430-490 TFLOP/s on an H200 against 344-356 for `torch._grouped_mm` and the fp32 add).

Then fc1 with the SwiGLU in quack's gated GEMM (`expert_gemm.fc1_swiglu`, what the experts' forward-only passes run
with `fused_kernels: [swiglu_gemm]`), weighted by each row's routing probability as `ColumnGroupedLinear` does,
against the two-kernel path (fc1's GEMM as above, then Megatron's weighted SwiGLU): milliseconds, and the largest
error against the fp64 activation in units of its largest magnitude.

    python bench/gpu_expert_gemm.py [--tokens 16384 --topk 8 --experts 128 --hidden 2048 --ffn 768] [--untuned]

`--untuned` leaves out the autotuned GEMM (its tuning takes most of the run).
"""

from __future__ import annotations

import json
import time

from cuda_timing import median_event_ms
from gpu_expert_wgrad import parse_layer_args, quack_importable, routed_rows


def _max_relative_error(out, exact, cu_seqlens, experts: int) -> float:
    """Largest over experts with rows of max |out_e - exact_e| / max |exact_e|; `exact(lo, hi, e)`: expert e's rows
    [lo, hi) in fp64."""
    worst = 0.0
    for expert in range(experts):
        lo, hi = int(cu_seqlens[expert]), int(cu_seqlens[expert + 1])
        if hi == lo:
            continue
        want = exact(lo, hi, expert)
        error = (out[lo:hi].double() - want).abs().max() / want.abs().max().clamp_min(1e-30)
        worst = max(worst, float(error))
    return worst


def main() -> None:
    args = parse_layer_args(__doc__, untuned=True)

    import torch

    from skyrl_megatron.model.moe import expert_gemm

    if not quack_importable():
        return
    from quack.gemm_interface import gemm, gemm_tuned

    device = torch.device("cuda")
    offsets, cu_seqlens, rows = routed_rows(args, device)
    for name, out_features, in_features in (("fc1", 2 * args.ffn, args.hidden), ("fc2", args.hidden, args.ffn)):
        weight = torch.randn(args.experts, out_features, in_features, device=device, dtype=torch.bfloat16)
        weight /= in_features**0.5
        x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
        grad_output = torch.randn(rows, out_features, device=device, dtype=torch.bfloat16)
        # (A, B as [E, K, N], the B of one expert for the reference): the forward reads the weight transposed
        directions = {
            "forward": (x, weight.transpose(1, 2), lambda e: weight[e].t()),
            "input_grad": (grad_output, weight, lambda e: weight[e]),
        }
        for direction, (a, b, b_of_expert) in directions.items():

            def product(lo: int, hi: int, expert: int, a=a, b_of_expert=b_of_expert):
                return a[lo:hi].double() @ b_of_expert(expert).double()

            routes = {
                "grouped_mm": lambda a=a, b=b: torch._grouped_mm(a, b, offs=offsets),
                "quack": lambda a=a, b=b: expert_gemm.matmul(a, b, offsets),  # what the layers call where `takes`
                "quack_tuned": lambda a=a, b=b: gemm(a, b, cu_seqlens_m=cu_seqlens, tuned=True),
            }
            if args.untuned:
                del routes["quack_tuned"]
            results = {}
            for label, fn in routes.items():
                try:
                    started = time.perf_counter()
                    out = fn()
                    torch.cuda.synchronize()
                    first_call_s = time.perf_counter() - started
                except Exception as error:  # noqa: BLE001 - a kernel the library cannot build here: say so, go on
                    results[label] = {"error": f"{type(error).__name__}: {error}"[:400]}
                    continue
                ms = median_event_ms(fn, args.repeats)
                flops = 2 * rows * out.shape[1] * a.shape[1]
                results[label] = {"ms": round(ms, 3), "first_call_s": round(first_call_s, 2),
                                  "tflops": round(flops / ms / 1e9, 1),
                                  "max_rel_error": _max_relative_error(out, product, cu_seqlens, args.experts)}
            if "ms" in results.get("quack_tuned", {}):  # the configuration the autotuner chose, to pin it by shape
                results["quack_tuned"]["config"] = str(getattr(gemm_tuned, "best_config", None))
            print(json.dumps({"projection": name, "direction": direction, "experts": args.experts, "rows": rows,
                              "out": out_features, "in": in_features, **results}), flush=True)

    _gated_fc1(args, offsets, cu_seqlens, rows, device)


def _gated_fc1(args, offsets, cu_seqlens, rows: int, device) -> None:
    """fc1 and the weighted SwiGLU: two kernels against quack's gated GEMM (one JSON line)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    from skyrl_megatron.model.moe import expert_gemm

    weight = torch.randn(args.experts, 2 * args.ffn, args.hidden, device=device, dtype=torch.bfloat16)
    weight *= 2 / args.hidden**0.5
    x = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16)
    probs = torch.rand(rows, 1, device=device, dtype=torch.float32)
    assert expert_gemm.takes_fc1_swiglu(x, weight)

    def weighted_swiglu(lo: int, hi: int, expert: int):
        gate, up = (x[lo:hi].double() @ weight[expert].double().t()).chunk(2, dim=-1)
        return F.silu(gate) * up * probs[lo:hi].double()

    routes = {
        "two_kernels": lambda: weighted_bias_swiglu_impl(expert_gemm.matmul(x, weight.transpose(1, 2), offsets), None,
                                                         probs),
        "epilogue": lambda: expert_gemm.fc1_swiglu(x, weight, offsets).mul_(probs),
        "gemm_alone": lambda: expert_gemm.matmul(x, weight.transpose(1, 2), offsets),
    }
    record = {"projection": "fc1_swiglu", "experts": args.experts, "rows": rows, "ffn": args.ffn, "hidden": args.hidden}
    with torch.no_grad():
        for label, fn in routes.items():
            started = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            result = {"first_call_s": round(time.perf_counter() - started, 2),
                      "ms": round(median_event_ms(fn, args.repeats), 3)}
            if label != "gemm_alone":
                result["max_rel_error"] = _max_relative_error(out, weighted_swiglu, cu_seqlens, args.experts)
            record[label] = result
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
