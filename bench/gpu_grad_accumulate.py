"""The experts' main_grad accumulation on one GPU: PyTorch's mixed-dtype `add_` against our kernel.

At the widths of an MoE layer's stacked experts (default: Qwen3-30B-A3B's 128 experts, fc1 [1536, 2048] and
fc2 [2048, 768] each), times `main_grad += grad` (fp32 += bf16) both ways with CUDA events (median of
`--repeats` after a warm-up), checks the results are bitwise equal, and that the grouped GEMM's weight
gradient (`torch._grouped_mm`, the layout `model/moe/experts.py` adds from) is one the kernel takes.
Prints one JSON line per shape: milliseconds and the effective bandwidth (10 bytes per element moved).

    python bench/gpu_grad_accumulate.py [--experts 128 --hidden 2048 --ffn 768 --tokens 16384]
"""

from __future__ import annotations

import argparse
import json

from cuda_timing import median_event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=16384, help="routed rows of the weight-gradient GEMM check")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    from skyrl_megatron.model.moe.grad_accumulate import _kernel_takes, accumulate_

    device = torch.device("cuda")

    def timed(fn) -> float:
        return median_event_ms(fn, args.repeats)

    for name, (rows, cols) in {"fc1": (2 * args.ffn, args.hidden), "fc2": (args.hidden, args.ffn)}.items():
        shape = (args.experts, rows, cols)
        grad = torch.randn(shape, device=device).bfloat16()
        main_grad = torch.randn(shape, device=device)
        want = main_grad.clone().add_(grad)
        got = accumulate_(main_grad.clone(), grad)
        equal = bool(torch.equal(want, got))
        del want, got
        torch_ms = timed(lambda: main_grad.add_(grad))
        ours_ms = timed(lambda: accumulate_(main_grad, grad))
        # the weight gradient as the experts' backward makes it: [E, out, in] from the routed rows
        x = torch.randn(args.tokens, cols, device=device).bfloat16()
        grad_output = torch.randn(args.tokens, rows, device=device).bfloat16()
        ends = torch.linspace(0, args.tokens, args.experts + 1, device=device)[1:].round().to(torch.int32)
        wgrad = torch._grouped_mm(grad_output.t(), x, offs=ends)
        gigabytes = main_grad.numel() * 10 / 1e9
        print(json.dumps({
            "shape": name, "experts": args.experts, "rows": rows, "cols": cols, "bitwise_equal": equal,
            "torch_add_ms": round(torch_ms, 3), "ours_ms": round(ours_ms, 3),
            "torch_add_TBps": round(gigabytes / torch_ms, 2), "ours_TBps": round(gigabytes / ours_ms, 2),
            "grouped_wgrad_shape": list(wgrad.shape), "kernel_takes_grouped_wgrad": _kernel_takes(main_grad, wgrad),
        }), flush=True)
        del grad, main_grad, x, grad_output, wgrad


if __name__ == "__main__":
    main()
