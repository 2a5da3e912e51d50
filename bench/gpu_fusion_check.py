"""The generated kernels of `megatron_config.fused_kernels` against the eager ones, on one GPU.

For each kernel, at the Qwen3-4B shapes of one 8192-token micro-batch: the largest error of the
values and input gradients of both versions against an fp64 reference (the fused kernel must not
be less accurate than the eager chain it replaces), and the device time of forward + backward
(median of CUDA-event timings after warm-up).

Usage (on the GPU machine): python bench/gpu_fusion_check.py --out fusions.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

TOKENS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 8192, 2560, 32, 8, 128, 9728


def _rms_norm_eager(x, weight):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def _rms_norm_fused(x, weight):
    from skyrl_megatron.model.norm import fused_rms_norm

    return fused_rms_norm(x, weight, 1e-6)


def _rope_eager(t, cos, sin):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    t = t.unsqueeze(1)
    return ((t * cos.unsqueeze(1)) + (_rotate_half(t, False) * sin.unsqueeze(1))).squeeze(1)


def _rope_fused(t, cos, sin):
    from skyrl_megatron.model.rope import fused_rotate_half_rope

    return fused_rotate_half_rope(t, cos, sin)


def _swiglu_eager(x):
    a, b = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _swiglu_fused(x):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_swiglu_impl(x, None)


def _cases(device):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * scale

    angles = torch.rand(TOKENS, 1, HEAD_DIM, device=device) * 100
    cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
    hidden_weight = (torch.rand(HIDDEN, device=device) + 0.5).to(torch.bfloat16)
    head_weight = (torch.rand(HEAD_DIM, device=device) + 0.5).to(torch.bfloat16)
    return {
        "rms_norm hidden [T, 2560]": (_rms_norm_eager, _rms_norm_fused, [randn(TOKENS, HIDDEN, scale=3)], [hidden_weight]),
        "rms_norm query heads [T, 32, 128]": (
            _rms_norm_eager, _rms_norm_fused, [randn(TOKENS, HEADS, HEAD_DIM, scale=3)], [head_weight]
        ),
        "rope query [T, 32, 128]": (_rope_eager, _rope_fused, [randn(TOKENS, HEADS, HEAD_DIM)], [cos, sin]),
        "rope key [T, 8, 128]": (_rope_eager, _rope_fused, [randn(TOKENS, GROUPS, HEAD_DIM)], [cos, sin]),
        "swiglu [T, 2 x 9728]": (_swiglu_eager, _swiglu_fused, [randn(TOKENS, 2 * FFN, scale=2)], []),
    }


def run_with_grads(fn, inputs, constants, grad):
    """fn(*inputs, *constants) and the gradients of `inputs` for `grad`."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves, *constants)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]


def _max_error(result, reference):
    out, grads = result
    ref_out, ref_grads = reference
    errors = [(out.double() - ref_out).abs().max().item()]
    errors += [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    return {"value": errors[0], "grad": max(errors[1:])}


def device_ms(fn, inputs, constants, grad, repeats: int = 20) -> float:
    """Median device time of forward + backward (CUDA events, after 3 warm-up calls)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    for _ in range(3):
        fn(*leaves, *constants).backward(grad)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*leaves, *constants).backward(grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(device: str = "cuda") -> dict:
    torch.manual_seed(0)
    report = {}
    for name, (eager, fused, inputs, constants) in _cases(device).items():
        out = eager(*inputs, *constants)
        grad = torch.randn_like(out)
        # fp64 reference: the eager chain on fp64 copies (Megatron's SwiGLU is fp64-capable too)
        reference = run_with_grads(eager, [x.double() for x in inputs], [c.double() for c in constants], grad.double())
        report[name] = {
            "eager_error": _max_error(run_with_grads(eager, inputs, constants, grad), reference),
            "fused_error": _max_error(run_with_grads(fused, inputs, constants, grad), reference),
            "eager_ms": device_ms(eager, inputs, constants, grad),
            "fused_ms": device_ms(fused, inputs, constants, grad),
        }
        print(name, json.dumps(report[name]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_fusion_check.json")
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": check()}
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
