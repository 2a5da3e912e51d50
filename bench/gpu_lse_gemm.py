"""The logprob head with its statistics in quack's GEMM epilogue (`fused_kernels: [lse_gemm]`) against the two-kernel
head, on one GPU.

One micro-batch's head at Qwen3's widths (hidden 2,048, vocabulary 151,936; `--tokens` rows, bf16, logits of a few
units to tens like a trained model's) through `compute.logprobs.vocab_parallel_logprobs` with the head's Triton
kernels, three ways: the two-kernel path (GEMM into bf16 logits, then the statistics kernel), the epilogue GEMM in a
scoring pass (no gradient: no logits written) and in a training forward (gradient and entropy: logits stored).
Printed as JSON lines: each way's largest logprob error against fp64 on `--exact-rows` rows, whether the scoring
and training forwards' logprobs are bitwise equal (they must be: the importance ratio compares them), the first
call's seconds (quack compiles its kernel there), and the median CUDA-event milliseconds of a scoring call and of a
training forward + backward.

    python bench/gpu_lse_gemm.py [--tokens 16384 --hidden 2048 --vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import time

from cuda_timing import median_event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--exact-rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch

    from skyrl_megatron.compute.logprobs import vocab_parallel_logprobs
    from skyrl_megatron.model import quack_support

    reason = quack_support.missing_reason(torch.cuda.current_device())
    print(json.dumps({"device": torch.cuda.get_device_name(), "quack": reason or "importable"}), flush=True)
    if reason is not None:
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * 8 / args.hidden**0.5).to(torch.bfloat16)
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    rows = slice(0, args.exact_rows)
    exact = torch.log_softmax(hidden[rows].double() @ weight.double().t(), dim=-1)
    exact = exact.gather(1, labels[rows].unsqueeze(1)).squeeze(1)

    def scoring(lse_gemm: bool):
        with torch.no_grad():
            return vocab_parallel_logprobs(hidden, weight, labels, fused=True, lse_gemm=lse_gemm).logprobs

    def training(lse_gemm: bool):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = vocab_parallel_logprobs(h, w, labels, fused=True, with_entropy=True, lse_gemm=lse_gemm,
                                      kept_logits_bytes=4096 * 2**20)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out.logprobs.detach()

    results = {}
    for name, fn in (("two_kernels_scoring", lambda: scoring(False)), ("epilogue_scoring", lambda: scoring(True)),
                     ("two_kernels_training", lambda: training(False)), ("epilogue_training", lambda: training(True))):
        started = time.perf_counter()
        logprobs = fn()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - started
        results[name] = logprobs
        error = (logprobs[rows].double() - exact).abs().max().item()
        ms = median_event_ms(fn, args.repeats)
        print(json.dumps({"case": name, "tokens": args.tokens, "ms": round(ms, 3), "first_call_s": round(first_call_s, 2),
                          "max_abs_error_vs_fp64": error}), flush=True)
    print(json.dumps({
        "epilogue_scoring_equals_training": bool(torch.equal(results["epilogue_scoring"], results["epilogue_training"])),
        "two_kernels_scoring_equals_training": bool(torch.equal(results["two_kernels_scoring"], results["two_kernels_training"])),
        "epilogue_vs_two_kernels_max_abs": (results["epilogue_scoring"] - results["two_kernels_scoring"]).abs().max().item(),
    }), flush=True)


if __name__ == "__main__":
    main()
