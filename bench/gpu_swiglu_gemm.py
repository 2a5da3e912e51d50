"""The dense MLP's fc1 GEMM with the SwiGLU in quack's epilogue (`fused_kernels: [swiglu_gemm]`) against the two-kernel
path (cuBLAS GEMM into bf16, then our Triton SwiGLU), on one GPU.

For each shape (`--shapes tokens:hidden:ffn,...`; by default a 1.7B scoring micro-batch of the bench's batch, 23,057
tokens, the 8,192-token training micro-batch, and Qwen3-4B's widths), bf16 operands with a trained model's scale:
each way's median CUDA-event milliseconds, the GEMM alone, the first call's seconds (quack compiles there), and the
largest error against fp64 on `--exact-rows` rows, in units of the result's largest magnitude. Printed as JSON lines.

Then the whole MLP's training pass (`--training-shapes`, the training micro-batch at 1.7B's and 4B's widths): fc1,
the SwiGLU and fc2 forward and backward, weight gradients added into fp32 `main_grad`, as Megatron's path runs it
(cuBLAS GEMMs, our Triton SwiGLU kernels, fp32-output weight-gradient GEMMs) against `swiglu_gemm_training`'s
(`swiglu_gemm.QuackKernels`: the gated GEMM storing fc1's output, `gemm_dgated` in fc2's input-gradient GEMM,
fc1's gradients through `concat_layout`), each way's milliseconds and its output's, input gradient's and weight
gradients' largest error against fp64 in units of each one's largest magnitude.

With `--tuned`, quack's autotuned kernels as a third way (the scoring GEMM and all five of the training pass), each
with the configuration its autotuner chose (`config`, to pin per width: the autotuner keys on shapes and tunes again for
every token count, so the product runs quack's default configuration).

    python bench/gpu_swiglu_gemm.py [--shapes 23057:2048:6144,8192:2048:6144,23057:2560:9728]
                                    [--training-shapes 8192:2048:6144,8192:2560:9728] [--tuned]
"""

from __future__ import annotations

import argparse
import json
import time

from cuda_timing import median_event_ms

DEFAULT_SHAPES = "23057:2048:6144,8192:2048:6144,23057:2560:9728,8192:2560:9728"
TRAINING_SHAPES = "8192:2048:6144,8192:2560:9728"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--exact-rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--training-shapes", default=TRAINING_SHAPES)
    parser.add_argument("--tuned", action="store_true", help="add quack's autotuned kernels as a third way")
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
        ways = [("two_kernels", lambda: swiglu_gemm.two_kernel_fc1_swiglu(x, weight)),
                ("epilogue", lambda: swiglu_gemm.fc1_swiglu(x, weight)),
                ("gemm_alone", lambda: x @ weight.t())]
        if args.tuned:
            from quack.gemm_interface import gemm_gated

            ways.append(("epilogue_tuned", lambda: gemm_gated(x, weight.mT, activation="swiglu", concat_layout=("B",),
                                                                store_preact=False, tuned=True)[1]))
        with torch.no_grad():
            for name, fn in ways:
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
                if name == "epilogue_tuned":
                    record["config"] = _chosen_configs()
                print(json.dumps(record), flush=True)
        print(json.dumps({"tokens": tokens, "hidden": hidden, "ffn": ffn,
                          "epilogue_vs_two_kernels_max_of_max":
                              (results["epilogue"].float() - results["two_kernels"].float()).abs().max().item() / scale}),
              flush=True)

    for shape in filter(None, args.training_shapes.split(",")):
        _training_pass(*(int(part) for part in shape.split(":")), repeats=args.repeats, tuned=args.tuned)


def _chosen_configs() -> dict[str, str]:
    """The configuration each of quack's autotuned GEMMs chose at its last call."""
    from quack import gemm_interface

    return {name: str(getattr(getattr(gemm_interface, name), "best_config", None))
            for name in ("gemm_tuned", "gemm_gated_tuned", "gemm_dgated_tuned")}


def _training_pass(tokens: int, hidden: int, ffn: int, repeats: int, tuned: bool) -> None:
    """One MLP training pass both ways (one JSON line per way)."""
    import torch
    import torch.nn.functional as F

    from skyrl_megatron.model.layers import swiglu_gemm, swiglu_kernels, wgrad

    gen = torch.Generator(device="cuda").manual_seed(tokens + ffn)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(2 * ffn, hidden, device="cuda", generator=gen) * 2 / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(hidden, ffn, device="cuda", generator=gen) / ffn**0.5).to(torch.bfloat16)
    grad_out = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    main_grad1 = torch.zeros(w1.shape, device="cuda")
    main_grad2 = torch.zeros(w2.shape, device="cuda")

    def megatrons():
        y = x @ w1.t()
        act = swiglu_kernels.swiglu_forward(y)
        out = act @ w2.t()
        grad_act = grad_out @ w2
        wgrad.wgrad_gemm_accum_fp32(act, grad_out, main_grad2)
        grad_y = swiglu_kernels.swiglu_backward(grad_act, y)
        grad_x = grad_y @ w1
        wgrad.wgrad_gemm_accum_fp32(x, grad_y, main_grad1)
        return out, grad_x

    class TunedKernels(swiglu_gemm.QuackKernels):
        tuned = True

    def gated(kernels=swiglu_gemm.QuackKernels):
        preact, act = kernels.fc1_gated(x, w1)
        out = act @ w2.t()
        grad_preact, act_again = kernels.fc2_dgated(grad_out, w2, preact)
        wgrad.wgrad_gemm_accum_fp32(act_again, grad_out, main_grad2)
        grad_x = kernels.fc1_input_grad(grad_preact, w1)
        kernels.fc1_weight_grad_add_(grad_preact, x, main_grad1)
        return out, grad_x

    leaves = [t.double().requires_grad_() for t in (x, w1, w2)]
    gate, up = (leaves[0] @ leaves[1].t()).chunk(2, dim=-1)
    exact_out = (F.silu(gate) * up) @ leaves[2].t()
    exact_out.backward(grad_out.double())
    exact = {"out": exact_out.detach(), "grad_x": leaves[0].grad, "grad_w1": leaves[1].grad, "grad_w2": leaves[2].grad}
    del gate, up, exact_out, leaves

    def error(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    ways = [("megatron", megatrons), ("swiglu_gemm_training", gated)]
    if tuned:
        ways.append(("swiglu_gemm_training_tuned", lambda: gated(TunedKernels)))
    for name, fn in ways:
        main_grad1.zero_()
        main_grad2.zero_()
        started = time.perf_counter()
        out, grad_x = fn()
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - started
        errors = {key: error(got, exact[key]) for key, got in
                  (("out", out), ("grad_x", grad_x), ("grad_w1", main_grad1), ("grad_w2", main_grad2))}
        ms = median_event_ms(fn, repeats, warmup=3)
        print(json.dumps({"training_case": name, "tokens": tokens, "hidden": hidden, "ffn": ffn, "ms": round(ms, 4),
                          "first_call_s": round(first_call_s, 2),
                          **{f"max_error_{key}_of_max": value for key, value in errors.items()},
                          **({"config": _chosen_configs()} if name.endswith("_tuned") else {})}), flush=True)


if __name__ == "__main__":
    main()
