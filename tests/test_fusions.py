"""The generated (torch.compile) kernels of `megatron_config.fused_kernels`, and where they are used.

The kernels run on GPU only; here they are compiled for CPU, which exercises the same graph
capture, dynamic shapes and autograd (a graph break fails: `fullgraph=True`).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.config import ConfigError
from skyrl_megatron.model.layers import rope
from skyrl_megatron.model.layers.norm import FusedRMSNorm, fused_rms_norm, rms_norm
from skyrl_megatron.validation import validate_config


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_torch_rmsnorm_values_and_gradients(dtype):
    torch.manual_seed(0)
    reference = torch.nn.RMSNorm(128, eps=1e-6, dtype=dtype)
    fused = FusedRMSNorm(128, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        fused.weight.copy_(reference.weight)
    assert fused.state_dict().keys() == reference.state_dict().keys()
    # two token counts and two row layouts: one compiled graph serves them (dynamic shapes)
    for shape in [(7, 4, 128), (13, 128)]:
        x = torch.randn(shape, dtype=dtype) * 3
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_fused = reference(x_ref), fused(x_fused)
        assert out_fused.dtype == dtype
        _close(out_fused, out_ref, dtype)
        grad = torch.randn_like(out_ref)
        out_ref.backward(grad)
        out_fused.backward(grad)
        _close(x_fused.grad, x_ref.grad, dtype)
        _close(fused.weight.grad.float(), reference.weight.grad.float(), dtype)
        reference.weight.grad = fused.weight.grad = None


def test_fused_rms_norm_runs_without_autograd():
    x, weight = torch.randn(5, 64), torch.rand(64)
    with torch.no_grad():
        torch.testing.assert_close(fused_rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))


def _megatron_rotation(t, cos, sin):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    t = t.unsqueeze(1)
    return ((t * cos.unsqueeze(1)) + (_rotate_half(t, False) * sin.unsqueeze(1))).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_rotation_matches_megatrons_values_and_gradients(dtype):
    torch.manual_seed(0)
    for tokens, heads in [(11, 4), (6, 2)]:  # query and key heads, two micro-batch sizes
        angles = torch.rand(tokens, 1, 16) * 10
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
        t = torch.randn(tokens, heads, 16, dtype=dtype)
        t_ref, t_fused = t.clone().requires_grad_(), t.clone().requires_grad_()
        out_ref, out_fused = _megatron_rotation(t_ref, cos, sin), rope.fused_rotate_half_rope(t_fused, cos, sin)
        _close(out_fused, out_ref, dtype)
        grad = torch.randn_like(out_ref)
        out_ref.backward(grad)
        out_fused.backward(grad)
        _close(t_fused.grad, t_ref.grad, dtype)


def test_fused_rope_is_used_by_packed_rope_once_installed(monkeypatch):
    """`apply_thd_rope` under `install(fused=True)` agrees with Megatron's per-sequence THD RoPE."""
    from megatron.core.models.common.embeddings import rope_utils

    megatron_thd = rope._MEGATRON_THD or rope_utils._apply_rotary_pos_emb_thd
    calls = []
    monkeypatch.setattr(rope, "fused_rotate_half_rope", lambda *a: calls.append(a) or rope.rotate_half_rope(*a))
    monkeypatch.setattr(rope, "_FUSED", True)
    rope._TABLES.clear()

    class _Group:
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    freqs = torch.rand(16, 1, 1, 8) * 10
    t = torch.randn(16, 3, 8)
    fused = rope.apply_thd_rope(t, cu_seqlens, freqs, cp_group=_Group())
    expected = megatron_thd(t, cu_seqlens, freqs, cp_group=_Group())
    assert len(calls) == 1
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5)
    rope._TABLES.clear()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    from skyrl_megatron.testing import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))


def test_fused_kernels_are_validated_by_name(compose):
    cfg = compose("trainer.policy.megatron_config.fused_kernels=[rms_norm,ropee]")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, run_host_checks=False)
    message = str(err.value)
    assert "trainer.policy.megatron_config.fused_kernels" in message
    assert "'ropee'" in message and "did you mean 'rope'" in message

    cfg = compose("trainer.policy.megatron_config.fused_kernels=rope")
    with pytest.raises(ConfigError, match=r"fused_kernels.*must be a list of kernel names"):
        validate_config(cfg, run_host_checks=False)


@pytest.mark.parametrize("kernels", [("rms_norm", "rope", "swiglu"), ()])
def test_gpu_provider_uses_the_fused_kernels_it_is_given(qwen3_dir, kernels, monkeypatch):
    """The provider a GPU worker builds: Megatron's SwiGLU fusion and our norms follow `fused_kernels`.

    Nothing is allocated: the provider is configured and its layer spec resolved, as on a GPU
    (the runtime object says CUDA; no CUDA call is made; no pipeline groups, so one stage).
    """
    from megatron.core.transformer import transformer_block

    from skyrl_megatron.model.build import ModelSpec, load_bridge, make_provider
    from skyrl_megatron.model.layers.norm import FusedTorchNorm, TorchNorm
    from skyrl_megatron.runtime import Device, Runtime

    hf_dir = qwen3_dir
    spec = ModelSpec(hf_dir, fused_kernels=kernels)
    provider = make_provider(spec, load_bridge(hf_dir), Runtime(Device.CUDA))
    assert provider.bias_activation_fusion is bool(kernels)
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    block = provider.transformer_layer_spec(provider)
    layer = block.layer_specs[0].submodules
    expected = FusedTorchNorm if kernels else TorchNorm
    assert block.layer_norm is expected
    assert layer.input_layernorm is expected and layer.self_attention.submodules.q_layernorm is expected


def test_cpu_provider_keeps_eager_kernels(qwen3_dir, monkeypatch):
    from megatron.core.transformer import transformer_block

    from skyrl_megatron.model.build import ModelSpec, load_bridge, make_provider
    from skyrl_megatron.model.layers.norm import TorchNorm
    from skyrl_megatron.runtime import Device, Runtime

    hf_dir = qwen3_dir
    provider = make_provider(ModelSpec(hf_dir), load_bridge(hf_dir), Runtime(Device.CPU))
    assert provider.bias_activation_fusion is False
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    assert provider.transformer_layer_spec(provider).layer_norm is TorchNorm


def test_user_setting_wins_over_the_swiglu_default(qwen3_dir):
    from skyrl_megatron.model.build import ModelSpec, load_bridge, make_provider
    from skyrl_megatron.runtime import Device, Runtime

    hf_dir = qwen3_dir
    spec = ModelSpec(hf_dir, transformer_overrides={"bias_activation_fusion": False})
    assert make_provider(spec, load_bridge(hf_dir), Runtime(Device.CUDA)).bias_activation_fusion is False


def test_fused_kernels_compile_once_per_call_site_not_per_micro_batch():
    """Once each call site (block norm, query norm, strided key norm, query/key rotation) has run
    for training and for scoring, new token counts reuse the compiled graphs: on GPU a recompile
    per micro-batch would cost seconds, and past Dynamo's recompile limit the kernels would run
    eagerly."""
    torch._dynamo.reset()
    norm = FusedRMSNorm(16, eps=1e-6)

    def call_sites(tokens: int, grad: bool):
        def leaf(*shape):
            return torch.randn(*shape, requires_grad=grad)

        qkv = leaf(tokens, 1, 2, 6, 16)
        cos, sin = torch.rand(tokens, 1, 16), torch.rand(tokens, 1, 16)
        outputs = [
            norm(leaf(tokens, 1, 16)),  # input / pre-MLP / final norm: [T, 1, hidden]
            norm(leaf(tokens, 1, 4, 16)),  # query norm: [T, 1, heads, head_dim]
            norm(qkv[:, :, :, 4]),  # key norm: a strided view of the QKV projection
            rope.fused_rotate_half_rope(leaf(tokens, 4, 16), cos, sin),
            rope.fused_rotate_half_rope(leaf(tokens, 2, 16), cos, sin),
        ]
        if grad:
            sum(out.sum() for out in outputs).backward()

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            call_sites(9, grad)
    with torch.compiler.set_stance("fail_on_recompile"):
        for tokens in (21, 5, 130):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    call_sites(tokens, grad)


@pytest.mark.parametrize("kernel", ["rms_norm", "rope"])
def test_fused_kernels_have_no_graph_breaks(kernel):
    from skyrl_megatron.model.layers.norm import rms_norm as function

    if kernel == "rope":
        function, args = rope.rotate_half_rope, (torch.randn(7, 2, 8), torch.rand(7, 1, 8), torch.rand(7, 1, 8))
    else:
        args = (torch.randn(7, 8), torch.rand(8), 1e-6)
    assert torch._dynamo.explain(function)(*args).graph_break_count == 0
