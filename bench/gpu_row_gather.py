"""The MoE permutation's row gather on one GPU: PyTorch's `index_select` against our Triton kernel.

`model/moe/token_permute.py` copies each token once per chosen expert (the permutation's forward, the
unpermute's backward). On a GPU it runs `row_gather_kernels.gather_rows`; the reference is `index_select`, which
it replaced (its `vectorized_gather_kernel`). The row numbers are a micro-batch's permutation order: random
top-k routing over `--experts`, rows grouped by expert, tokens ascending within an expert, as Megatron orders
them. Default 16,384 tokens, top-8 of 128 experts, hidden 2,048 (Qwen3-30B-A3B's widths; `--hidden 4096` for
Qwen3-235B-A22B's). Both are timed with CUDA events (median of `--repeats` after a warm-up); the outputs must be
equal bit for bit. Each launch shape in `--shapes` (columns per program x warps) is timed, the kernel's default
first; one JSON line each, with the bytes written and read once over the time (TB/s).

    python bench/gpu_row_gather.py [--tokens 16384 --topk 8 --hidden 2048] [--shapes 2048x4,2048x8,1024x4]
"""

from __future__ import annotations

import argparse
import json

from cuda_timing import median_event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default="2048x4,2048x8,1024x4,4096x8",
                        help="columns per program x warps, comma-separated")
    args = parser.parse_args()

    import torch

    from skyrl_megatron.model.moe import row_gather_kernels, token_permute

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    chosen = torch.rand(args.tokens, args.experts, device=device, generator=generator).topk(args.topk, dim=1).indices
    routing_map = torch.zeros(args.tokens, args.experts, dtype=torch.bool, device=device).scatter_(1, chosen, True)
    # Megatron's order (token_permute.permute): expert-major, tokens ascending within an expert
    flat = routing_map.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[: args.tokens * args.topk]
    token_of_row = flat % args.tokens
    default = (row_gather_kernels._BLOCK, row_gather_kernels._WARPS)
    shapes = [default] + [shape for shape in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
                          if shape != default]
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(args.tokens, args.hidden, device=device, generator=generator).to(dtype)
        assert token_permute._gather_takes(x, token_of_row)
        want = x.index_select(0, token_of_row)
        reference_ms = median_event_ms(lambda: x.index_select(0, token_of_row), args.repeats)
        gigabytes = 2 * want.numel() * want.element_size() / 1e9
        for block, warps in shapes:
            row_gather_kernels._BLOCK, row_gather_kernels._WARPS = block, warps
            got = token_permute._gather(x, token_of_row)
            kernel_ms = median_event_ms(lambda: token_permute._gather(x, token_of_row), args.repeats)
            print(json.dumps({
                "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens, "topk": args.topk,
                "hidden": args.hidden, "block": block, "warps": warps, "default": (block, warps) == default,
                "index_select_ms": round(reference_ms, 3), "kernel_ms": round(kernel_ms, 3),
                "index_select_TBps": round(gigabytes / reference_ms, 2), "kernel_TBps": round(gigabytes / kernel_ms, 2),
                "equal": bool(torch.equal(got, want)),
            }), flush=True)
        row_gather_kernels._BLOCK, row_gather_kernels._WARPS = default
        del x, want, got


if __name__ == "__main__":
    main()
