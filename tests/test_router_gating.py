"""The router's fp32 gating without upcast operands (model/moe/router_gating.py).

On a CPU its forward is the upcast GEMM, so it must equal Megatron's `RouterGatingLinearFunction`
bitwise in both directions, whatever the input's leading shape and the gradient's strides (the CUDA
forward, cuBLAS's fp32-output GEMM, is checked against it on an H200 by `bench/gpu_router_gating.py`).
Every case outside fp32 routing of bf16/fp16 operands without a bias goes to Megatron's function; a built
bf16 MoE model routes through ours, with bitwise the same logits and gradients as with Megatron's.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks


@pytest.fixture
def gating():
    from megatron.core.transformer.moe import moe_utils, router

    from skyrl_megatron.model.moe import router_gating

    router_gating.install()
    assert router.router_gating_linear is router_gating.router_gating_linear
    yield router_gating
    router_gating.uninstall()
    assert router.router_gating_linear is moe_utils.router_gating_linear


def _megatron(inp, weight, bias, dtype):
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    return RouterGatingLinearFunction.apply(inp, weight, bias, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 2), (5,)], ids=["seq_batch", "tokens"])
def test_fp32_gating_equals_megatrons_in_both_directions(gating, dtype, shape):
    g = torch.Generator().manual_seed(1)
    hidden, experts = 24, 8
    base_inp = torch.randn(*shape, hidden, generator=g).to(dtype)
    base_weight = (0.2 * torch.randn(experts, hidden, generator=g)).to(dtype)
    # the router's gradient arrives fp32 and, after top-k's gathers, not always contiguous
    grad = torch.randn(experts, *shape, generator=g).movedim(0, -1)
    assert not grad.is_contiguous()
    results = []
    for fn in (gating.router_gating_linear, _megatron):
        inp, weight = base_inp.clone().requires_grad_(), base_weight.clone().requires_grad_()
        logits = fn(inp, weight, None, torch.float32)
        logits.backward(grad)
        results.append((logits, inp.grad, weight.grad))
    (ours, ours_dx, ours_dw), (want, want_dx, want_dw) = results
    assert ours.dtype == torch.float32 and ours.shape == (*shape, experts)
    assert ours_dx.dtype == dtype and ours_dw.dtype == dtype
    assert torch.equal(ours, want) and torch.equal(ours_dx, want_dx) and torch.equal(ours_dw, want_dw)


@pytest.mark.parametrize(
    "case",
    ["bias", "fp64_routing", "model_dtype_routing", "fp32_activations", "te_installed"],
)
def test_every_other_case_is_megatrons_function(gating, monkeypatch, case):
    calls = []
    original = gating._originals["router_gating_linear"]
    monkeypatch.setitem(gating._originals, "router_gating_linear", lambda *a: calls.append(a) or original(*a))
    fast = []
    monkeypatch.setattr(gating._GatingFp32Out, "apply", lambda *a: fast.append(a))
    inp, weight, bias, router_dtype = torch.randn(4, 8).bfloat16(), torch.randn(3, 8).bfloat16(), None, torch.float32
    if case == "bias":
        bias = torch.zeros(3).bfloat16()
    elif case == "fp64_routing":
        router_dtype = torch.float64
    elif case == "model_dtype_routing":
        router_dtype = torch.bfloat16
    elif case == "fp32_activations":
        inp, weight = inp.float(), weight.float()
    else:
        monkeypatch.setitem(gating._originals, "te_missing", False)
    gating.router_gating_linear(inp, weight, bias, router_dtype)
    assert len(calls) == 1 and not fast
    # and the case this module is for takes the fast path
    if case == "bias":
        gating.router_gating_linear(inp, weight, None, torch.float32)
        assert len(fast) == 1 and len(calls) == 1


def _model_both_gatings(rank, world_size, hf_dir: str) -> dict:
    from megatron.core.transformer.moe import router

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.moe import router_gating
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    spec = ModelSpec(hf_dir, parallel=parallel, dtype="bf16", wrap_with_ddp=True,
                     ddp_config={"grad_reduce_in_fp32": True}, transformer_overrides={"moe_grouped_gemm": True})
    model = build_model(spec).chunks[0]
    out = {"installed": router.router_gating_linear is router_gating.router_gating_linear, "runs": []}
    fast_calls = []
    original_apply = router_gating._GatingFp32Out.apply
    router_gating._GatingFp32Out.apply = lambda *a: fast_calls.append(1) or original_apply(*a)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    try:
        for ours in (True, False):
            router.router_gating_linear = (
                router_gating.router_gating_linear if ours else router_gating._originals["router_gating_linear"]
            )
            fast_calls.clear()
            model.zero_grad_buffer()
            logits = model(tokens, positions, None)
            logits.float().square().mean().backward()
            grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
            out["runs"].append({"fast_calls": len(fast_calls), "logits": logits.detach().clone(), "grads": grads})
    finally:
        router_gating._GatingFp32Out.apply = original_apply
        router.router_gating_linear = router_gating.router_gating_linear
    return out


@pytest.mark.slow
def test_a_bf16_moe_model_routes_through_it_with_bitwise_megatrons_results(tmp_path):
    hf_dir = tmp_path / "hf"
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=3)
    out = run_on_ranks(_model_both_gatings, 1, str(hf_dir))[0]
    assert out["installed"]
    ours, megatron = out["runs"]
    assert ours["fast_calls"] == 4 and megatron["fast_calls"] == 0  # one per MoE layer
    assert torch.equal(ours["logits"], megatron["logits"])
    routers = [n for n in ours["grads"] if ".router." in n]
    assert routers and all(torch.count_nonzero(ours["grads"][n]) for n in routers)
    for name, grad in megatron["grads"].items():
        assert torch.equal(ours["grads"][name], grad), name
