"""The dense MLP's gated GEMMs in training passes (`fused_kernels: [swiglu_gemm_training]`, model/layers/mlp.py over
`swiglu_gemm.SwiGLUMLPFunction`).

quack's kernels run on Hopper or later GPUs only. Here their PyTorch definitions (`swiglu_gemm.ReferenceKernels`, in
quack's layouts: fc1's output with gate and up columns interleaved) take their place, so what is checked is
everything around them: a tiny dense model trained with it gives the logits and the gradients of the model without
it (DDP's fp32 `main_grad` under gradient-accumulation fusion, or plain `.grad`), at world 1, under TP2 with
sequence parallelism (the shard gathered in the forward and again in the backward, the input's gradient
reduce-scattered) and under TP2 without it (the input's gradient summed), and with full recompute (a no-grad first
forward, then the recomputation through the Function); scoring through the forward-only schedule and training give
the same logits; the activation is not saved for the backward. `bench/gpu_swiglu_gemm.py` runs quack's kernels
themselves against these definitions on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.layers import swiglu_gemm
from skyrl_megatron.testing import padded_token_rows, run_on_ranks

SEQ_LENGTHS = (7, 12, 5)


class _Recorded(swiglu_gemm.ReferenceKernels):
    """The reference kernels, each call's name recorded."""

    calls: list = []

    @classmethod
    def _record(cls, name):
        cls.calls.append(name)

    @staticmethod
    def fc1_gated(x, w1):
        _Recorded._record("fc1_gated")
        return swiglu_gemm.ReferenceKernels.fc1_gated(x, w1)

    @staticmethod
    def fc2_dgated(grad_out, w2, preact):
        _Recorded._record("fc2_dgated")
        return swiglu_gemm.ReferenceKernels.fc2_dgated(grad_out, w2, preact)


def _trained(rank: int, world: int, hf_dir: str, layout: dict, ddp: bool, recompute: bool) -> dict:
    """One tiny dense model built with `swiglu_gemm_training` and one without (same checkpoint, fp32): this rank's
    logits from a training forward and from the forward-only schedule, the gradients of one backward, and which
    kernels ran."""
    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch
    from skyrl_megatron.compute.schedule import forward_only as forward_only_schedule
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel)
    ModelSpec.fused = lambda self, kernel, runtime: kernel in self.fused_kernels  # a GPU setting, taken on CPU here
    quack_support.current_device_missing_reason = lambda: None
    swiglu_gemm.takes = lambda x, weight: x.dim() == 2 and weight.shape[1] == x.shape[1] and weight.shape[0] % 2 == 0
    swiglu_gemm.fc1_swiglu = lambda x, weight: (_Recorded.calls.append("fc1_swiglu")
                                                or swiglu_gemm.reference_fc1_swiglu(x, weight))
    swiglu_gemm.TRAINING_KERNELS = _Recorded

    tokens, mask = padded_token_rows(SEQ_LENGTHS, seed=3)
    packed = pack_padded_batch(tokens, mask, parallel)
    overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}
    ddp_config = {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False} if ddp else {}

    def forward(model, micro_batch):
        return model(micro_batch.tokens, micro_batch.position_ids, None, packed_seq_params=micro_batch.packed_seq_params)

    out = {}
    for name, kernels in (("fused", ("swiglu_gemm_training",)), ("reference", ())):
        built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", fused_kernels=kernels,
                                      wrap_with_ddp=ddp, ddp_config=ddp_config, transformer_overrides=overrides))
        model = built.chunks[0]
        _Recorded.calls.clear()
        trained = forward(model, packed)
        (trained * torch.linspace(-1, 1, trained.shape[-1])).sum().backward()
        training_calls = list(_Recorded.calls)
        _Recorded.calls.clear()
        scored = forward_only_schedule(built.chunks, [packed], forward, lambda output, mb: output.detach(),
                                       seq_length=packed.num_tokens, micro_batch_size=1)[0]
        grads = {}
        for param_name, param in model.named_parameters():
            grad = param.main_grad if ddp else param.grad
            if grad is not None:
                grads[param_name] = grad.detach().clone()
        out[name] = {
            "kernels": built.fused_kernels,
            "mlp": type(model.module.decoder.layers[0].mlp if ddp else model.decoder.layers[0].mlp).__name__,
            "training_calls": training_calls,
            "scoring_calls": list(_Recorded.calls),
            "trained": trained.detach(),
            "scored": scored,
            "grads": grads,
            "layers": built.provider.num_layers,
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world, layout, ddp, recompute", [
    (1, {}, True, False),
    (2, {"tensor": 2, "sequence_parallel": True}, True, False),
    (2, {"tensor": 2}, False, False),
    (1, {}, True, True),
], ids=["world1-ddp", "tp2-sp-ddp", "tp2-no-sp", "world1-full-recompute"])
def test_a_model_trained_with_it_equals_the_model_without(tmp_path, world, layout, ddp, recompute):
    from skyrl_megatron.testing import make_tiny_hf_model

    make_tiny_hf_model("qwen3", tmp_path, seed=6)
    for result in run_on_ranks(_trained, world, str(tmp_path), layout, ddp, recompute, timeout=300):
        fused, reference = result["fused"], result["reference"]
        layers = fused["layers"]
        assert "swiglu_gemm_training" in fused["kernels"] and "swiglu_gemm_training" not in reference["kernels"]
        assert fused["mlp"] == "SwiGLUGemmTrainingMLP" and reference["mlp"] == "MLP"
        # each layer once forward and once backward through the Function; under full recompute, a no-grad forward
        # through the scoring epilogue first (the same activation, so the recomputation matches what it replays)
        expected = ["fc1_swiglu"] * layers if recompute else []
        expected += ["fc1_gated"] * layers + ["fc2_dgated"] * layers
        assert sorted(fused["training_calls"]) == sorted(expected)
        assert fused["scoring_calls"] == ["fc1_swiglu"] * layers and reference["training_calls"] == []
        torch.testing.assert_close(fused["trained"], reference["trained"], atol=1e-5, rtol=1e-5)
        # the model scores through the arithmetic it trains with
        torch.testing.assert_close(fused["scored"], fused["trained"], atol=1e-6, rtol=0)
        assert fused["grads"].keys() == reference["grads"].keys() and fused["grads"]
        for name, grad in reference["grads"].items():
            scale = grad.abs().max().clamp_min(1e-12)
            assert (fused["grads"][name] - grad).abs().max() / scale < 1e-5, name


def test_the_reference_kernels_are_the_swiglu_mlp_and_its_gradients():
    """`ReferenceKernels` (quack's layouts) against autograd through fc1, the SwiGLU and fc2 in Megatron's layout."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=generator, dtype=torch.float64)
    w1 = torch.randn(2 * 12, 16, generator=generator, dtype=torch.float64) / 4
    w2 = torch.randn(16, 12, generator=generator, dtype=torch.float64) / 4
    grad_out = torch.randn(9, 16, generator=generator, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    gate, up = (leaves[0] @ leaves[1].t()).chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate) * up) @ leaves[2].t()
    y.backward(grad_out)

    kernels = swiglu_gemm.ReferenceKernels
    close = {"rtol": 1e-5, "atol": 1e-5}  # the kernels' products are fp32's
    preact, postact = kernels.fc1_gated(x, w1)
    torch.testing.assert_close(postact @ w2.t(), y.detach(), **close)
    torch.testing.assert_close(preact[:, 0::2], gate.detach(), **close)  # interleaved: gate, up, gate, up, ...
    grad_preact, recomputed = kernels.fc2_dgated(grad_out, w2, preact)
    torch.testing.assert_close(recomputed, postact, **close)
    torch.testing.assert_close(grad_out.t() @ recomputed, leaves[2].grad, **close)
    torch.testing.assert_close(kernels.fc1_input_grad(grad_preact, w1), leaves[0].grad, **close)
    torch.testing.assert_close(kernels.fc1_weight_grad(grad_preact, x), leaves[1].grad, **close)
    main_grad = torch.ones_like(w1)
    kernels.fc1_weight_grad_add_(grad_preact, x, main_grad)
    torch.testing.assert_close(main_grad, 1 + leaves[1].grad, **close)


def test_the_function_saves_fc1s_output_not_the_activation():
    """What the backward keeps: the input, fc1's [n, 2f] output and the weights; the [n, f] activation is written
    again by fc2's input-gradient GEMM."""
    swiglu_gemm.TRAINING_KERNELS, before = swiglu_gemm.ReferenceKernels, swiglu_gemm.TRAINING_KERNELS
    try:
        x = torch.randn(6, 8, requires_grad=True)
        w1 = torch.randn(2 * 5, 8, requires_grad=True)
        w2 = torch.randn(8, 5, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            y = swiglu_gemm.SwiGLUMLPFunction.apply(x, w1, w2, False, None, False)
        assert sorted(saved) == sorted([(6, 8), (6, 10), (10, 8), (8, 5)])
        y.sum().backward()
        assert x.grad is not None and w1.grad is not None and w2.grad is not None
    finally:
        swiglu_gemm.TRAINING_KERNELS = before


def test_the_build_takes_it_only_where_asked_and_quack_runs(monkeypatch, caplog):
    from skyrl_megatron.model import build, quack_support
    from skyrl_megatron.runtime import Device, Runtime

    spec = build.ModelSpec("unused")
    assert "swiglu_gemm_training" not in spec.fused_kernels  # opt-in
    asked = build.ModelSpec("unused", fused_kernels=("swiglu_gemm_training",))
    monkeypatch.setattr(quack_support, "current_device_missing_reason", lambda: None)
    assert build._quack_kernel_runs(asked, Runtime(Device.CUDA), "swiglu_gemm_training", otherwise="")
    monkeypatch.setattr(quack_support, "current_device_missing_reason", lambda: "it needs a Hopper or later GPU")
    with caplog.at_level("INFO", logger=build.logger.name):
        assert not build._quack_kernel_runs(asked, Runtime(Device.CUDA), "swiglu_gemm_training",
                                            otherwise="dense MLP training: fc1, the SwiGLU kernel, fc2")
    assert "dense MLP training: fc1, the SwiGLU kernel, fc2 (swiglu_gemm_training: it needs a Hopper" in caplog.text
