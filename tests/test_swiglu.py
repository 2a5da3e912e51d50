"""`fused_kernels: [swiglu]` on GPU: the dense MLP's SwiGLU as Triton kernels (model/layers/swiglu.py).

The kernels run under Triton's interpreter on CPU (a fresh process: TRITON_INTERPRET is read when triton is
imported) against autograd through `silu(y1) * y2`, and through Megatron's MLP entry point once installed;
calls the kernels do not take (a bias, CPU tensors) reach Megatron's own function.
"""

from __future__ import annotations

import torch

from skyrl_megatron.model.layers import swiglu
from skyrl_megatron.testing import last_word_under_triton_interpreter

_TRITON_CHECK = """
import torch
from megatron.core.transformer import mlp
from skyrl_megatron.model.layers import swiglu, swiglu_kernels

def reference(y):
    gate, up = torch.chunk(y.float(), 2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)

cases = 0
for dtype in (torch.float32, torch.bfloat16):
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    # widths below, at and past one program's 1024 columns (masked tails); an empty micro-batch
    for rows, width in [(3, 1024), (5, 1300), (2, 40), (0, 64)]:
        generator = torch.Generator().manual_seed(rows * width)
        y = (torch.randn(rows, 2 * width, generator=generator) * 3).to(dtype)
        grad = torch.randn(rows, width, generator=generator).to(dtype)
        y_ref = y.float().requires_grad_()
        want = reference(y_ref)
        want.backward(grad.float())
        out = swiglu_kernels.swiglu_forward(y)
        assert out.shape == (rows, width) and out.dtype == dtype
        torch.testing.assert_close(out, want.to(dtype), **tolerance)
        grad_y = swiglu_kernels.swiglu_backward(grad, y)
        assert grad_y.shape == y.shape and grad_y.dtype == dtype
        torch.testing.assert_close(grad_y, y_ref.grad.to(dtype), **tolerance)
        cases += 1

# through Megatron's MLP entry point, [s, b, 2 * ffn] as the MLP passes it, taken as on a GPU
swiglu.install()
swiglu._on_gpu = lambda t: True
y = torch.randn(4, 2, 2 * 48, dtype=torch.float64).float().requires_grad_()
out = mlp.bias_swiglu_impl(y, None, False, False)
assert out.shape == (4, 2, 48)
assert type(out.grad_fn.next_functions[0][0]).__name__ == "_SwiGLUBackward"  # through the kernels' Function
grad = torch.randn_like(out)
out.backward(grad)
y_ref = y.detach().clone().requires_grad_()
reference(y_ref).backward(grad)
torch.testing.assert_close(out, reference(y.detach()), atol=1e-5, rtol=1e-5)
torch.testing.assert_close(y.grad, y_ref.grad, atol=1e-5, rtol=1e-5)
print("checked", cases + 1)
"""


def test_the_triton_kernels_equal_autograd_through_silu_times_up():
    assert last_word_under_triton_interpreter(_TRITON_CHECK, timeout=300) == str(2 * 4 + 1)


def test_calls_the_kernels_do_not_take_reach_megatrons_function(monkeypatch):
    from megatron.core.transformer import mlp

    swiglu.install()
    swiglu.install()  # idempotent: Megatron's function stays the fallback
    assert mlp.bias_swiglu_impl is swiglu.bias_swiglu_impl
    assert swiglu._MEGATRON_IMPL is not swiglu.bias_swiglu_impl
    seen = []
    monkeypatch.setattr(swiglu, "_MEGATRON_IMPL", lambda *args: seen.append(args) or "megatron")
    y = torch.randn(3, 8)
    assert mlp.bias_swiglu_impl(y, None, False, False) == "megatron"  # CPU
    monkeypatch.setattr(swiglu, "_on_gpu", lambda t: True)
    assert mlp.bias_swiglu_impl(y, torch.zeros(8), False, False) == "megatron"  # a bias
    assert mlp.bias_swiglu_impl(y, None, True, False) == "megatron"  # fp8-stored input
    assert mlp.bias_swiglu_impl(y, None, False, True) == "megatron"  # offloaded activations
    assert len(seen) == 4
