"""The MoE combine's sum of each token's k expert rows on one GPU: PyTorch's chain against our kernel.

`model/moe/token_permute.py` sums a token's k rows (the unpermute's forward, the permutation's backward). On a
GPU it runs one Triton pass (`row_sum_kernels.py`); elsewhere, and here as the reference, PyTorch's gather into a
[tokens, k, hidden] copy, fp32 reduction and cast. At a micro-batch of the MoE bench (default: 16,384 tokens,
top-8, hidden 2,048: Qwen3-30B-A3B's widths; `--hidden 4096` for Qwen3-235B-A22B's) this times both with CUDA
events (median of `--repeats` after a warm-up), reports how many outputs differ from the chain and by how much
(both accumulate in fp32, in possibly different orders), and the effective bandwidth of the kernel (each row read once,
each sum written once). One JSON line per dtype.

    python bench/gpu_row_sum.py [--tokens 16384 --topk 8 --hidden 2048]
"""

from __future__ import annotations

import argparse
import json

from cuda_timing import median_event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    from skyrl_megatron.model.moe import token_permute

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(args.tokens * args.topk, args.hidden, device=device, generator=generator).to(dtype)
        token_of_row = torch.randperm(args.tokens * args.topk, device=device, generator=generator) % args.tokens
        rows = token_permute.rows_by_token(token_of_row, args.tokens)
        assert token_permute._kernel_takes(x, rows)
        chain = lambda: token_permute._chain_sums(x, rows)  # noqa: E731
        kernel = lambda: token_permute._sum_rows(x, rows)  # noqa: E731
        want, got = chain(), kernel()
        differ = (want != got)
        # in units of the last place at the sums' largest magnitude: a per-output measure blows up where a
        # sum cancels to near zero and the two orders of addition leave different last bits
        scale_ulp = torch.finfo(dtype).eps * float(want.float().abs().max())
        chain_ms, kernel_ms = median_event_ms(chain, args.repeats), median_event_ms(kernel, args.repeats)
        gigabytes = (x.numel() + got.numel()) * x.element_size() / 1e9
        print(json.dumps({
            "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens, "topk": args.topk,
            "hidden": args.hidden, "chain_ms": round(chain_ms, 3), "kernel_ms": round(kernel_ms, 3),
            "kernel_TBps": round(gigabytes / kernel_ms, 2), "outputs_differing": int(differ.sum()),
            "largest_difference_in_scale_ulps": round(float((want.float() - got.float()).abs().max()) / scale_ulp, 3),
        }), flush=True)
        del x, token_of_row, rows, want, got, differ


if __name__ == "__main__":
    main()
