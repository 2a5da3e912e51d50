"""The dense MLP's fc1 with the SwiGLU in the GEMM's epilogue in forward-only passes (`fused_kernels: [swiglu_gemm]`,
model/layers/mlp.py over model/layers/swiglu_gemm.py).

quack's gated GEMM runs on Hopper or later GPUs only. Here its PyTorch stand-in, `swiglu_gemm.reference_fc1_swiglu`
(the fp32 product, the activation, one rounding), takes its place, so what is checked is everything around the
kernel: a whole tiny model scored through the forward-only schedule equals the model without it, at world 1 and
under TP2 with sequence parallelism (each rank's [gate; up] fc1 shard, the gathered sequence); training forwards,
a recomputed layer's first forward (no gradients, but not forward-only) and LoRA's wrapper around fc1 keep
Megatron's path, bit for bit; what the kernel takes. With `swiglu_gemm_experts` the grouped MoE experts take the
same epilogue through quack's varying-M gated GEMM (`expert_gemm.fc1_swiglu`, its stand-in
`expert_gemm.reference_fc1_swiglu`), the routing probability multiplied after it: a tiny Qwen3-MoE scored with it
equals the model without at world 1, EP2 and TP2 x ETP2; without it the experts keep Megatron's path. `bench/gpu_swiglu_gemm.py` and `bench/gpu_expert_gemm.py` run quack's kernels themselves against fp64
and the two-kernel paths on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.layers import forward_only, swiglu_gemm
from skyrl_megatron.model.moe import expert_gemm
from skyrl_megatron.testing import padded_token_rows, run_on_ranks

SEQ_LENGTHS = (7, 12, 5)


def _rank_with_stand_in(parallel) -> list:
    """This rank's process groups for `parallel`, the GPU-only kernel settings taken on CPU, and the stand-in for
    quack's kernel (this process): it takes CPU tensors and records each call's row shape in the list returned."""
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.model.build import ModelSpec
    from skyrl_megatron.parallel import init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(parallel)
    ModelSpec.fused = lambda self, kernel, runtime: kernel in self.fused_kernels  # a GPU setting, taken on CPU here
    quack_support.current_device_missing_reason = lambda: None
    calls: list = []
    swiglu_gemm.takes = lambda x, weight: x.dim() == 2 and weight.shape[1] == x.shape[1] and weight.shape[0] % 2 == 0
    swiglu_gemm.fc1_swiglu = lambda x, weight: (calls.append(("dense", x.shape[0]))
                                                or swiglu_gemm.reference_fc1_swiglu(x, weight))
    expert_gemm.takes_fc1_swiglu = lambda a, weight: a.dim() == 2 and weight.dim() == 3 and weight.shape[2] == a.shape[1]
    expert_gemm.fc1_swiglu = lambda a, weight, offsets: (calls.append(("experts", a.shape[0]))
                                                         or expert_gemm.reference_fc1_swiglu(a, weight, offsets))
    return calls


def _scored_and_trained(rank: int, world: int, hf_dir: str, layout: dict) -> dict:
    """One tiny model built with `swiglu_gemm` and one without (same checkpoint, fp32): this rank's logits from the
    forward-only schedule, from a training forward (and its gradients), from a no-grad forward outside the schedule,
    and the kernel's calls in each."""
    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch
    from skyrl_megatron.compute.schedule import forward_only as forward_only_schedule
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig

    parallel = ParallelConfig(**layout)
    calls = _rank_with_stand_in(parallel)

    tokens, mask = padded_token_rows(SEQ_LENGTHS, seed=3)
    packed = pack_padded_batch(tokens, mask, parallel)

    def forward(model, micro_batch):
        return model(micro_batch.tokens, micro_batch.position_ids, None, packed_seq_params=micro_batch.packed_seq_params)

    out = {}
    for name, kernels in (("fused", ("swiglu_gemm", "swiglu_gemm_experts")), ("reference", ())):
        built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", fused_kernels=kernels))
        model = built.chunks[0]
        calls.clear()
        scored = forward_only_schedule(built.chunks, [packed], forward, lambda output, mb: output.detach(),
                                       seq_length=packed.num_tokens, micro_batch_size=1)[0]
        scoring_calls = list(calls)
        calls.clear()
        trained = forward(model, packed)
        (trained * torch.linspace(-1, 1, trained.shape[-1])).sum().backward()
        with torch.no_grad():  # as a recomputed layer's first forward runs: no gradients, not forward-only
            no_grad = forward(model, packed)
        mlps = [layer.mlp for layer in model.decoder.layers]
        out[name] = {
            "kernels": built.fused_kernels,
            "mlp": type(mlps[0]).__name__,
            "layers": len(mlps),
            "scoring_calls": scoring_calls,
            "other_calls": list(calls),
            "scored": scored,
            "trained": trained.detach(),
            "no_grad": no_grad,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "tokens": packed.num_tokens,
            "topk": built.provider.moe_router_topk,
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, world, layout", [
    ("qwen3", 1, {}),
    ("qwen3", 2, {"tensor": 2, "sequence_parallel": True}),
    ("qwen3_moe", 1, {}),
    ("qwen3_moe", 2, {"expert": 2}),
    ("qwen3_moe", 2, {"tensor": 2, "sequence_parallel": True, "expert_tensor": 2}),
], ids=["dense-world1", "dense-tp2-sp", "moe-world1", "moe-ep2", "moe-tp2-etp2"])
def test_a_model_scored_with_it_equals_the_model_without(tmp_path, family, world, layout):
    from skyrl_megatron.testing import make_tiny_hf_model

    make_tiny_hf_model(family, tmp_path, seed=6)
    for result in run_on_ranks(_scored_and_trained, world, str(tmp_path), layout, timeout=300):
        fused, reference = result["fused"], result["reference"]
        kernel = "swiglu_gemm" if family == "qwen3" else "swiglu_gemm_experts"
        assert kernel in fused["kernels"] and kernel not in reference["kernels"]
        calls = fused["scoring_calls"]
        assert len(calls) == fused["layers"]  # every layer once
        if family == "qwen3":
            assert fused["mlp"] == "SwiGLUGemmMLP" and reference["mlp"] == "MLP"
            # over the whole packed sequence (under SP: every rank's shard gathered)
            assert calls == [("dense", fused["tokens"])] * len(calls)
        else:
            # the experts' rows: the top-k copies of every rank's tokens that this rank's experts take (EP, ETP)
            assert all(kind == "experts" and 0 < rows <= world * fused["tokens"] * fused["topk"] for kind, rows in calls)
            if world == 1:
                assert calls == [("experts", fused["tokens"] * fused["topk"])] * len(calls)
        assert fused["other_calls"] == [] and reference["scoring_calls"] == []
        torch.testing.assert_close(fused["scored"], reference["scored"], atol=1e-5, rtol=1e-5)
        # the training forward and a no-grad forward outside the schedule keep Megatron's path: bit for bit
        assert torch.equal(fused["trained"], reference["trained"])
        assert torch.equal(fused["no_grad"], reference["no_grad"])
        assert fused["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            assert torch.equal(fused["grads"][name], grad), name


def _mlp_calls(rank: int, world: int, hf_dir: str, family: str, wrap_fc1: bool, kernels: tuple) -> dict:
    """The kernel's calls in one forward-only pass of the first layer's MLP (dense or MoE)."""
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig

    calls = _rank_with_stand_in(ParallelConfig())
    built = build_model(ModelSpec(hf_dir, dtype="fp32", fused_kernels=kernels))
    mlp = built.chunks[0].decoder.layers[0].mlp
    owner = getattr(mlp, "experts", mlp)
    if wrap_fc1:  # as an adapter wraps fc1: its output is no longer the plain GEMM's

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x, *args):
                out, bias = self.inner(x, *args)
                return out + 1.0, bias

        owner.linear_fc1 = Wrapped(owner.linear_fc1)
    hidden = torch.randn(6, 1, built.provider.hidden_size)
    with torch.no_grad(), forward_only.forward_only_pass():
        mlp(hidden)
    return {"calls": [kind for kind, _ in calls], "kernels": built.fused_kernels}


@pytest.mark.slow
@pytest.mark.parametrize("family, wrap_fc1, kernels, expected_calls", [
    ("qwen3", False, ("swiglu_gemm",), ["dense"]),
    ("qwen3", True, ("swiglu_gemm",), []),
    ("qwen3_moe", False, ("swiglu_gemm", "swiglu_gemm_experts"), ["experts"]),
    ("qwen3_moe", True, ("swiglu_gemm", "swiglu_gemm_experts"), []),
    ("qwen3_moe", False, ("swiglu_gemm",), []),  # the default: the experts keep Megatron's path
], ids=["dense", "dense-wrapped-fc1", "moe", "moe-wrapped-fc1", "moe-default"])
def test_the_fused_call_is_taken_only_by_plain_fc1s_where_asked(tmp_path, family, wrap_fc1, kernels, expected_calls):
    from skyrl_megatron.testing import make_tiny_hf_model

    make_tiny_hf_model(family, tmp_path, seed=6)
    (result,) = run_on_ranks(_mlp_calls, 1, str(tmp_path), family, wrap_fc1, kernels, timeout=300)
    assert result["calls"] == expected_calls
    kernel = "swiglu_gemm" if family == "qwen3" else "swiglu_gemm_experts"
    assert (kernel in result["kernels"]) == (kernel in kernels)  # as built, whether or not a call could take it


def test_the_experts_take_it_only_for_the_plain_weighted_swiglu():
    from megatron.core.transformer import TransformerConfig

    from skyrl_megatron.model.moe.experts import swiglu_epilogue_applies

    def config(**overrides):
        base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, add_bias_linear=False, num_moe_experts=4)
        return TransformerConfig(**{**base, **overrides})

    assert swiglu_epilogue_applies(config())
    assert not swiglu_epilogue_applies(config(gated_linear_unit=False))
    assert not swiglu_epilogue_applies(config(activation_func=torch.nn.functional.gelu))
    assert not swiglu_epilogue_applies(config(add_bias_linear=True))
    assert not swiglu_epilogue_applies(config(activation_func_clamp_value=7.0))
    assert not swiglu_epilogue_applies(config(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True))


def test_the_grouped_stand_in_is_each_experts_activation_of_the_fp32_product_rounded_once():
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(3, 2 * 8, 16, generator=generator) / 4).to(torch.bfloat16)
    x = torch.randn(11, 16, generator=generator).to(torch.bfloat16)
    offsets = torch.tensor([4, 4, 11], dtype=torch.int32)  # the second expert has no rows
    out = expert_gemm.reference_fc1_swiglu(x, weight, offsets)
    assert out.dtype == torch.bfloat16 and out.shape == (11, 8)
    for expert, (start, end) in enumerate([(0, 4), (4, 4), (4, 11)]):
        assert torch.equal(out[start:end], swiglu_gemm.reference_fc1_swiglu(x[start:end], weight[expert]))
    assert not expert_gemm.takes_fc1_swiglu(x, weight)  # CPU tensors: Megatron's path
    if torch.cuda.is_available():
        assert expert_gemm.takes_fc1_swiglu(x.cuda(), weight.cuda())
        assert not expert_gemm.takes_fc1_swiglu(x.cuda(), weight[:, :15].cuda())  # an odd row count


def test_forward_only_is_set_by_the_pass_and_needs_gradients_off():
    assert not forward_only.active()
    with torch.no_grad():
        assert not forward_only.active()  # a recomputed layer's first forward
        with forward_only.forward_only_pass():
            assert forward_only.active()
            with torch.enable_grad():
                assert not forward_only.active()
        assert not forward_only.active()


def test_the_stand_in_is_the_activation_of_the_fp32_product_rounded_once():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(2 * 24, 32, generator=generator) / 4).to(torch.bfloat16)
    gate, up = (x.double() @ weight.double().t()).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    fused = swiglu_gemm.reference_fc1_swiglu(x, weight)
    two_kernels = swiglu_gemm.two_kernel_fc1_swiglu(x, weight)
    assert fused.dtype == torch.bfloat16 and fused.shape == (9, 24)
    fused_error = (fused.double() - exact).abs().max().item()
    two_kernel_error = (two_kernels.double() - exact).abs().max().item()
    # one rounding: within half a bf16 unit of the exact value (relative 2**-9)
    assert torch.all((fused.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6)
    assert fused_error <= two_kernel_error


def test_what_the_kernel_takes():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.randn(2 * 32, 64, dtype=torch.bfloat16)
    assert not swiglu_gemm.takes(x, weight)  # CPU tensors: the two-kernel path
    if not torch.cuda.is_available():
        return
    x, weight = x.cuda(), weight.cuda()
    assert swiglu_gemm.takes(x, weight)
    assert not swiglu_gemm.takes(x.float(), weight.float())  # fp32
    assert not swiglu_gemm.takes(x[:, 1:], weight[:, 1:])  # unaligned, non-contiguous
    assert not swiglu_gemm.takes(x[:0], weight)  # no rows
    assert not swiglu_gemm.takes(x, weight[:63])  # an odd row count: no [gate; up] halves


def test_the_build_takes_it_where_quack_runs_and_logs_why_not(monkeypatch, caplog):
    from skyrl_megatron.model import build, quack_support
    from skyrl_megatron.runtime import Device, Runtime

    spec = build.ModelSpec("unused")
    assert "swiglu_gemm" in spec.fused_kernels  # a default
    monkeypatch.setattr(quack_support, "current_device_missing_reason", lambda: None)
    assert build._swiglu_in_gemm(spec, Runtime(Device.CUDA))
    assert not build._swiglu_in_gemm(spec, Runtime(Device.CPU))  # the CPU runtime: the two-kernel path
    monkeypatch.setattr(quack_support, "current_device_missing_reason", lambda: "it needs a Hopper or later GPU")
    with caplog.at_level("INFO", logger=build.logger.name):
        assert not build._swiglu_in_gemm(spec, Runtime(Device.CUDA))
    assert "swiglu_gemm: it needs a Hopper or later GPU" in caplog.text
    monkeypatch.setattr(quack_support, "current_device_missing_reason", lambda: pytest.fail("probed quack"))
    assert not build._swiglu_in_gemm(build.ModelSpec("unused", fused_kernels=("swiglu",)), Runtime(Device.CUDA))
