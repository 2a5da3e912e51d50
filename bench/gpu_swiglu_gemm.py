"""The dense MLP's fc1 GEMM with the SwiGLU in quack's epilogue (`fused_kernels: [swiglu_gemm]`) against the two-kernel
path (cuBLAS GEMM into bf16, then our Triton SwiGLU), on one GPU.

For each shape (`--shapes tokens:hidden:ffn,...`; by default a 1.7B scoring micro-batch of the bench's batch, 23,057
tokens, the 8,192-token training micro-batch, and Qwen3-4B's widths), bf16 operands with a trained model's scale:
each way's median CUDA-event milliseconds, the GEMM alone, the first call's seconds (quack compiles there), and the
largest error against fp64 on `--exact-rows` rows, in units of the result's largest magnitude. Printed as JSON lines.

    python bench/gpu_swiglu_gemm.py [--shapes 23057:2048:6144,8192:2048:6144,23057:2560:9728]
"""

from __future__ import annotations

import argparse
import json
import time

from cuda_timing import median_event_ms

DEFAULT_SHAPES = "23057:2048:6144,8192:2048:6144,23057:2560:9728,8192:2560:9728"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--exact-rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from skyrl_megatron.model import quack_support
    from skyrl_megatron.model.layers import swiglu_gemm

    reason = quack_support.missing_reason(torch.cuda.current_device())
    print(json.dumps({"device": torch.cuda.get_device_name(), "quack": reason or "importable"}), flush=True)
    if reason is not None:
        return
    for shape in args.shapes.split(","):
        tokens, hidden, ffn = (int(part) for part in shape.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(tokens + hidden)
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(2 * ffn, hidden, device="cuda", generator=gen) * 2 / hidden**0.5).to(torch.bfloat16)
        assert swiglu_gemm.takes(x, weight)
        rows = slice(0, args.exact_rows)
        gate, up = (x[rows].double() @ weight.double().t()).chunk(2, dim=-1)
        exact = F.silu(gate) * up
        scale = exact.abs().max().item()
        results = {}
        with torch.no_grad():
            for name, fn in (("two_kernels", lambda: swiglu_gemm.two_kernel_fc1_swiglu(x, weight)),
                             ("epilogue", lambda: swiglu_gemm.fc1_swiglu(x, weight)),
                             ("gemm_alone", lambda: x @ weight.t())):
                started = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                first_call_s = time.perf_counter() - started
                record = {"case": name, "tokens": tokens, "hidden": hidden, "ffn": ffn,
                          "ms": round(median_event_ms(fn, args.repeats, warmup=3), 4),
                          "first_call_s": round(first_call_s, 2)}
                if name != "gemm_alone":
                    results[name] = out
                    record["max_error_vs_fp64_of_max"] = (out[rows].double() - exact).abs().max().item() / scale
                print(json.dumps(record), flush=True)
        print(json.dumps({"tokens": tokens, "hidden": hidden, "ffn": ffn,
                          "epilogue_vs_two_kernels_max_of_max":
                              (results["epilogue"].float() - results["two_kernels"].float()).abs().max().item() / scale}),
              flush=True)


if __name__ == "__main__":
    main()
