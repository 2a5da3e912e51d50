"""flash-attn-4's varlen attention over the bench's micro-batches, in the query/key/value layouts of both sides.

In the Qwen3-4B profile of `policy_bench.py` the same flash-attn-4 kernels, on the same sequences, took longer in
our workers than in the plain FSDP2 loop. What differs is the memory layout handed to the kernel:
- `ours`: query and key contiguous token-major [T, heads, dim] (our norm + rotation kernel writes them), value a
  view into the fused QKV projection's output (row stride (heads per group + 2) x groups x dim);
- `loop`: HF's rotated [heads, T, dim] tensors seen as [T, heads, dim] (head-major), value likewise;
- `contiguous`: all three contiguous token-major.
This times `flash_attn.cute.flash_attn_varlen_func` forward, and forward + backward, over the micro-batches the
bench packs (its RL batch, our planner's first-fit-decreasing token budget) for each layout, with CUDA events
(median of `--repeats` passes over all micro-batches after a warm-up), and checks that the layouts give the same
output. One JSON line per layout.

    python bench/gpu_fa4_layout.py [--heads 32 --groups 8 --dim 128 --token-budget 8192]
"""

from __future__ import annotations

import argparse
import json
import math

from cuda_timing import median_event_ms


def segment_lengths(token_budget: int) -> list[list[int]]:
    """The sequence lengths of each training micro-batch of the bench's RL batch."""
    import torch
    from fsdp2_loop import host_rows
    from policy_bench import BatchShape, rl_batch

    from skyrl_megatron.compute.microbatch.plan import plan_micro_batches

    shape = BatchShape()
    rows = host_rows(rl_batch(shape, vocab_size=1000, pad_token_id=0), shape.prompt_tokens)
    lengths = torch.tensor([len(row.tokens) for row in rows])
    return [[int(lengths[i]) for i in group] for group in plan_micro_batches(lengths, max_tokens=token_budget).groups]


def layouts(tokens: int, heads: int, groups: int, dim: int):
    """(query, key, value) [T, heads or groups, dim] bf16 CUDA tensors, leaves with gradients, per layout."""
    import torch

    def leaf(t):
        return t.detach().requires_grad_()

    generator = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(tokens, heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    k = torch.randn(tokens, groups, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    v = torch.randn(tokens, groups, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    per_group = heads // groups
    fused = torch.empty(tokens, groups, (per_group + 2) * dim, device="cuda", dtype=torch.bfloat16)
    fused[:, :, (per_group + 1) * dim:] = v
    value_view = leaf(fused)[:, :, (per_group + 1) * dim:]  # the value Megatron's split hands on
    return {
        "ours": (leaf(q), leaf(k), value_view),
        "loop": tuple(leaf(t.transpose(0, 1).contiguous()).transpose(0, 1) for t in (q, k, v)),
        "contiguous": (leaf(q), leaf(k), leaf(v)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch
    from flash_attn.cute import flash_attn_varlen_func

    batches = segment_lengths(args.token_budget)
    prepared = []
    for lengths in batches:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        prepared.append((cu, max(lengths), layouts(offsets[-1], args.heads, args.groups, args.dim)))

    def attend(cu, longest: int, tensors):
        q, k, v = tensors
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                     max_seqlen_k=longest, softmax_scale=1 / math.sqrt(args.dim), causal=True)
        return out[0] if isinstance(out, tuple) else out

    reference = [attend(cu, longest, t["contiguous"]).float() for cu, longest, t in prepared]
    for name in ("ours", "loop", "contiguous"):
        def forward(name=name):
            with torch.no_grad():
                for cu, longest, tensors in prepared:
                    attend(cu, longest, tensors[name])

        def forward_backward(name=name):
            for cu, longest, tensors in prepared:
                out = attend(cu, longest, tensors[name])
                out.backward(torch.ones_like(out))

        difference = max(float((attend(cu, longest, t[name]).float() - want).abs().max())
                         for (cu, longest, t), want in zip(prepared, reference))
        print(json.dumps({
            "layout": name, "micro_batches": len(batches), "tokens": sum(map(sum, batches)),
            "forward_ms": round(median_event_ms(forward, args.repeats), 2),
            "forward_backward_ms": round(median_event_ms(forward_backward, args.repeats), 2),
            "largest_difference_from_contiguous": difference,
        }), flush=True)


if __name__ == "__main__":
    main()
