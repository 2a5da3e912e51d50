"""Gradient-accumulation fusion through our PyTorch weight-gradient GEMMs (`model/layers/wgrad.py`).

On GPU this is a speed setting (no separate bf16 weight gradient, no per-micro-batch add into the
fp32 buffer); here it must not change the training step: the same loss and main gradients as
the unfused path over several micro-batches (CPU, fp32), with the fused path demonstrably taken.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.layers import wgrad
from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulating_gemm_adds_the_weight_gradient_in_place(dtype):
    g = torch.Generator().manual_seed(0)
    total_input = torch.randn(40, 8, generator=g).to(dtype)  # [tokens, in]
    grad_output = torch.randn(40, 5, generator=g).to(dtype)  # [tokens, out]
    main_grad = torch.randn(5, 8, generator=g)  # fp32 [out, in]
    expected = main_grad + grad_output.float().t() @ total_input.float()
    buffer = main_grad.data_ptr()
    wgrad.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == buffer
    torch.testing.assert_close(main_grad, expected, rtol=1e-6, atol=1e-5)

    half = main_grad.to(dtype)
    wgrad.wgrad_gemm_accum_fp16(total_input, grad_output, half)
    assert half.dtype == dtype


def test_install_offers_the_extension_to_megatron():
    import sys

    from megatron.core.tensor_parallel import layers

    assert wgrad.install()
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda is sys.modules[wgrad.EXTENSION]
    assert wgrad.install()  # idempotent


def _loss_and_grads(rank, world_size, hf_dir: str) -> dict:
    from megatron.core.utils import get_model_config

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing.policy_steps import train_one_mini_batch
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    init_distributed("cpu")
    batch = make_rl_batch(6, 6, 6, seed=5)
    results = {}
    for name, overrides in {"unfused": {"gradient_accumulation_fusion": False}, "fused": {}}.items():
        built, metrics = train_one_mini_batch(  # three micro-batches of 2 rows accumulate
            hf_dir, batch, transformer_overrides=overrides,
            ddp_config={"use_distributed_optimizer": False, "grad_reduce_in_fp32": True},
        )
        config = get_model_config(built.chunks[0])
        layer = built.chunks[0].module.decoder.layers[0]
        results[name] = {
            "loss": metrics["loss"],
            "grads": {n: p.main_grad.clone() for n, p in built.chunks[0].named_parameters()},
            "fused": (config.gradient_accumulation_fusion, layer.mlp.linear_fc1.gradient_accumulation_fusion),
        }
    # without DDP there is no main_grad to accumulate into: plain weight gradients in .grad
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    bare = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32")).chunks[0]
    logits = bare(batch["sequences"][:2], torch.arange(batch["sequences"].shape[1]).unsqueeze(0), None)
    logits.float().square().mean().backward()
    results["without_ddp"] = {
        "fused": get_model_config(bare).gradient_accumulation_fusion,
        "grads": all(p.grad is not None for p in bare.parameters()),
    }
    return results


@pytest.mark.slow
def test_fused_accumulation_keeps_loss_and_gradients(tmp_path):
    make_tiny_hf_model("qwen3", tmp_path, seed=11)
    (results,) = run_on_ranks(_loss_and_grads, 1, str(tmp_path), timeout=600)
    unfused, fused = results["unfused"], results["fused"]
    assert unfused["fused"] == (False, False)
    assert fused["fused"] == (True, True)  # on by default where the GEMMs are available
    assert results["without_ddp"] == {"fused": False, "grads": True}
    assert fused["loss"] == unfused["loss"]
    assert fused["grads"].keys() == unfused["grads"].keys()
    for name, grad in unfused["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
