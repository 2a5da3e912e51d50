"""The kernels of `megatron_config.fused_kernels` against the eager ones, on one GPU.

For each kernel, at the Qwen3-4B shapes of one 8192-token micro-batch: the largest error of the values and input
gradients (the norms' weights count as inputs) of both versions against an fp64 reference (the fused kernel must not
be less accurate than the eager chain it replaces), the device time of forward + backward (median of CUDA-event
timings after warm-up, `*_ms`, and the kernels' busy time in a profile, `*_busy_ms`, which leaves out the host's
launch gaps that events around a sub-millisecond kernel also time), and the host's time per call with the device
kept busy (`*_host_ms`: what a host-bound step pays). Where the fused kernel replaced an earlier one (the Triton
query/key norm + rotation and SwiGLU replaced torch.compile-generated ones), that one is checked and timed too
("previous"); for the block's RMSNorm, quack-kernels' RMSNorm too ("library"), where it is installed. The logprob
head (forward + backward of one micro-batch at vocabulary 151,936; `--no-head` leaves it out) runs eager, with the
generated kernels it had, with the Triton ones, and with those and forward's logits kept for the backward.

Usage (on the GPU machine): python bench/gpu_fusion_check.py --out fusions.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

TOKENS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 8192, 2560, 32, 8, 128, 9728
VOCAB = 151936


def _rms_norm_eager(x, weight):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def _rms_norm_fused(x, weight):
    """The block's norm as `fused_kernels: [rms_norm]` builds it (our Triton kernels)."""
    from skyrl_megatron.model.layers.norm import _TritonRMSNorm

    return _TritonRMSNorm.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, 1e-6).view(x.shape)


@functools.cache
def _generated_rms_norm():
    from skyrl_megatron.model.layers.fusions import compile_kernel

    def rms_norm(x, weight, eps):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    return compile_kernel(rms_norm)


def _rms_norm_quack(x, weight):
    """quack-kernels' RMSNorm (CuTe DSL; installed with flash-attn-4), the library candidate for the block's norms."""
    from quack.rmsnorm import rmsnorm

    return rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps=1e-6).view(x.shape)


def _rms_norm_generated(x, weight):
    """The torch.compile-generated RMSNorm the Triton kernels replaced."""
    return _generated_rms_norm()(x.reshape(-1, x.shape[-1]).contiguous(), weight, 1e-6).view(x.shape)


def _rope_eager(t, cos, sin):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    t = t.unsqueeze(1)
    return ((t * cos.unsqueeze(1)) + (_rotate_half(t, False) * sin.unsqueeze(1))).squeeze(1)


def _rope_fused(t, cos, sin):
    from skyrl_megatron.model.layers.rope import fused_rotate_half_rope

    return fused_rotate_half_rope(t, cos, sin)


def _swiglu_eager(x):
    a, b = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(a) * b


def _swiglu_fused(x):
    from skyrl_megatron.model.layers import swiglu

    swiglu.install()
    return swiglu.bias_swiglu_impl(x, None)


def _swiglu_megatron(x):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    return bias_swiglu_impl(x, None)


def _split_qkv(mixed):
    """query [T, groups, heads per group, dim] and key [T, groups, dim], views into the QKV projection's output."""
    query, key, _ = torch.split(mixed, [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    return query.unflatten(-1, (HEADS // GROUPS, HEAD_DIM)), key


def _qk_norm_rope_eager(mixed, weight, cos, sin):
    """torch's RMSNorm then Megatron's rotation, per head, on query and key (both outputs concatenated)."""
    query, key = _split_qkv(mixed)
    normed = [_rms_norm_eager(t.reshape(TOKENS, -1, HEAD_DIM), weight) for t in (query, key)]
    return torch.cat([_rope_eager(t, cos, sin).flatten(1) for t in normed], dim=-1)


def _qk_norm_rope_with(kernels):
    def run(mixed, weight, cos, sin):
        from skyrl_megatron.model.layers import qk_norm_rope

        chosen, qk_norm_rope._kernels = qk_norm_rope._kernels, kernels
        try:
            query, key = _split_qkv(mixed)
            return torch.cat([qk_norm_rope.norm_rope(t, weight, cos, sin, 1e-6).reshape(TOKENS, -1)
                              for t in (query, key)], dim=-1)
        finally:
            qk_norm_rope._kernels = chosen
    return run


def _qk_norm_rope_fused(mixed, weight, cos, sin):
    from skyrl_megatron.model.layers import norm_rope_kernels

    return _qk_norm_rope_with(lambda device: (norm_rope_kernels.norm_rope_forward,
                                              norm_rope_kernels.norm_rope_backward))(mixed, weight, cos, sin)


@functools.cache
def _generated_norm_rope():
    from skyrl_megatron.model.layers import qk_norm_rope
    from skyrl_megatron.model.layers.fusions import compile_kernel

    return compile_kernel(qk_norm_rope.norm_rope_forward), compile_kernel(qk_norm_rope.norm_rope_backward)


def _qk_norm_rope_generated(mixed, weight, cos, sin):
    """The kernels the Triton ones replaced: the reference functions generated by torch.compile."""
    return _qk_norm_rope_with(lambda device: _generated_norm_rope())(mixed, weight, cos, sin)


def _cases(device):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * scale

    angles = torch.rand(TOKENS, 1, HEAD_DIM, device=device) * 100
    cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
    hidden_weight = (torch.rand(HIDDEN, device=device) + 0.5).to(torch.bfloat16)
    head_weight = (torch.rand(HEAD_DIM, device=device) + 0.5).to(torch.bfloat16)
    return {
        # the norms' weights are inputs: their gradient is part of every side's backward, as in training
        "rms_norm hidden [T, 2560]": (_rms_norm_eager, _rms_norm_fused, [randn(TOKENS, HIDDEN, scale=3), hidden_weight],
                                      [], _rms_norm_generated),
        "rms_norm hidden [T, 2048]": (_rms_norm_eager, _rms_norm_fused, [randn(TOKENS, 2048, scale=3),
                                      hidden_weight[:2048].clone()], [], _rms_norm_generated),
        "rms_norm query heads [T, 32, 128]": (
            _rms_norm_eager, _rms_norm_fused, [randn(TOKENS, HEADS, HEAD_DIM, scale=3), head_weight], []
        ),
        "rope query [T, 32, 128]": (_rope_eager, _rope_fused, [randn(TOKENS, HEADS, HEAD_DIM)], [cos, sin]),
        "rope key [T, 8, 128]": (_rope_eager, _rope_fused, [randn(TOKENS, GROUPS, HEAD_DIM)], [cos, sin]),
        "swiglu [T, 2 x 9728]": (_swiglu_eager, _swiglu_fused, [randn(TOKENS, 2 * FFN, scale=2)], [],
                                 _swiglu_megatron),
        "qk_norm_rope query + key, read inside [T, 8, (4 + 2) x 128]": (
            _qk_norm_rope_eager, _qk_norm_rope_fused,
            [randn(TOKENS, GROUPS, (HEADS // GROUPS + 2) * HEAD_DIM, scale=3)], [head_weight, cos, sin],
            _qk_norm_rope_generated),
    }


_LIBRARY_CASES = {"rms_norm hidden [T, 2560]": _rms_norm_quack, "rms_norm hidden [T, 2048]": _rms_norm_quack}


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


def _warm_leaves(fn, inputs, constants, grad) -> list:
    """Fresh leaves of `inputs` after 3 untimed forward + backward calls of `fn` on them."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    for _ in range(3):
        fn(*leaves, *constants).backward(grad)
    return leaves


def device_ms(fn, inputs, constants, grad, repeats: int = 20) -> float:
    """Median device time of forward + backward (CUDA events, after 3 warm-up calls)."""
    leaves = _warm_leaves(fn, inputs, constants, grad)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*leaves, *constants).backward(grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_busy_ms(fn, inputs, constants, grad, repeats: int = 20) -> float:
    """Device time of forward + backward with the host's gaps left out: the kernels' merged busy time in a profile
    of `repeats` calls (after warm-up), per call. Events around a sub-millisecond norm or rotation time the host's
    launches as much as the kernels (the gaps a training step fills with queued work); this times the kernels."""
    from gpu_idle import from_profiler

    leaves = _warm_leaves(fn, inputs, constants, grad)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(repeats):
            fn(*leaves, *constants).backward(grad)
        torch.cuda.synchronize()
    return from_profiler(profiler).busy_us / 1e3 / repeats


def host_ms(fn, inputs, constants, grad, repeats: int = 50) -> float:
    """Host time of forward + backward per call with the device kept busy (a sleep kernel queued first, so no call
    waits for the GPU): what one call costs the thread that launches a step's kernels. Where a step is host-bound,
    a kernel whose host time exceeds the eager chain's loses end to end what it saves on the device."""
    leaves = _warm_leaves(fn, inputs, constants, grad)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second at the H100/H200's clocks: longer than the loop below
    started = time.perf_counter()
    for _ in range(repeats):
        fn(*leaves, *constants).backward(grad)
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed * 1e3 / repeats


def _side(label: str, fn, inputs, constants, grad, reference) -> dict:
    """One version's `{label}_error` against the fp64 reference, `{label}_ms` (events), `{label}_busy_ms` (profile),
    `{label}_host_ms` (the host's launch time, the device kept busy)."""
    return {f"{label}_error": _max_error(run_with_grads(fn, inputs, constants, grad), reference),
            f"{label}_ms": device_ms(fn, inputs, constants, grad),
            f"{label}_busy_ms": device_busy_ms(fn, inputs, constants, grad),
            f"{label}_host_ms": host_ms(fn, inputs, constants, grad)}


def check(device: str = "cuda") -> dict:
    torch.manual_seed(0)
    report = {}
    for name, (eager, fused, inputs, constants, *previous) in _cases(device).items():
        out = eager(*inputs, *constants)
        grad = torch.randn_like(out)
        # fp64 reference: the eager chain on fp64 copies (Megatron's SwiGLU is fp64-capable too)
        reference = run_with_grads(eager, [x.double() for x in inputs], [c.double() for c in constants], grad.double())
        report[name] = {**_side("eager", eager, inputs, constants, grad, reference),
                        **_side("fused", fused, inputs, constants, grad, reference)}
        for earlier in previous:
            report[name].update(_side("previous", earlier, inputs, constants, grad, reference))
        if name in _LIBRARY_CASES:  # a maintained library's kernel for the same job, where installed
            try:
                report[name].update(_side("library", _LIBRARY_CASES[name], inputs, constants, grad, reference))
            except Exception as error:  # noqa: BLE001 - not installed or not built here: say so, go on
                report[name]["library"] = f"{type(error).__name__}: {error}"[:300]
        print(name, json.dumps(report[name]), flush=True)
    return report


def _logprob_head(route: str):
    """The training head at one micro-batch (logprobs with the entropy as a metric, as the workers ask):
    `eager` chains, the `generated` (torch.compile) kernels the Triton ones replaced, `triton`, and
    `triton_kept` (the default: forward's logits kept for the backward)."""
    from skyrl_megatron.compute import logprobs

    def run(hidden, weight, labels):
        triton_runs_on = logprobs._triton_runs_on
        if route == "generated":
            logprobs._triton_runs_on = lambda device: False
        try:
            return logprobs.vocab_parallel_logprobs(
                hidden, weight, labels, with_entropy=True, fused=route != "eager",
                kept_logits_bytes=logprobs.DEFAULT_LOGITS_KEPT_BYTES if route == "triton_kept" else 0,
            ).logprobs
        finally:
            logprobs._triton_runs_on = triton_runs_on

    return run


def check_logprob_head(device: str = "cuda") -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, device=device) / HIDDEN**0.5).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (TOKENS,), device=device)
    grad = torch.randn(TOKENS, device=device)
    # the eager head on fp32 copies (its weight-gradient GEMM has no fp64 route on CUDA; it computes in fp32)
    reference = run_with_grads(_logprob_head("eager"), [hidden.float(), weight.float()], [labels], grad)
    report = {}
    for route in ("eager", "generated", "triton", "triton_kept"):
        fn = _logprob_head(route)
        report[route] = {
            "error": _max_error(run_with_grads(fn, [hidden, weight], [labels], grad), reference),
            "ms": device_ms(fn, [hidden, weight], [labels], grad),
        }
        print(f"logprob head [{TOKENS}, {HIDDEN}] x [{VOCAB}]", route, json.dumps(report[route]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_fusion_check.json")
    parser.add_argument("--no-head", action="store_true", help="the layers' kernels only, not the logprob head")
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": check()}
    if not args.no_head:
        report["logprob_head"] = check_logprob_head()
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
