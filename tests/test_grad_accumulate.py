"""The experts' fp32 += bf16/fp16 gradient accumulation (model/moe/grad_accumulate.py).

The GPU's Triton kernel runs under Triton's interpreter on CPU (a fresh process: TRITON_INTERPRET is read
when triton is imported) and must equal PyTorch's mixed-dtype `add_` bitwise; calls it does not take reach
`add_` itself.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.moe import grad_accumulate
from skyrl_megatron.testing import last_word_under_triton_interpreter

_TRITON_CHECK = """
import torch
from skyrl_megatron.model.moe import grad_accumulate_kernels

cases = 0
for dtype in (torch.bfloat16, torch.float16):
    # below one program's 8,192 elements, exactly one, and past it (a masked tail)
    for numel in (5, 8192, 3 * 8192 + 77):
        generator = torch.Generator().manual_seed(numel)
        target = torch.randn(numel, generator=generator) * 100
        addend = (torch.randn(numel, generator=generator) * 1e-3).to(dtype)
        want = target.clone().add_(addend)
        grad_accumulate_kernels.accumulate_flat(target, addend)
        assert torch.equal(target, want), (dtype, numel, (target - want).abs().max())
        cases += 1
print("checked", cases)
"""


def test_the_triton_kernel_equals_torchs_mixed_dtype_add_bitwise():
    assert last_word_under_triton_interpreter(_TRITON_CHECK, timeout=300) == "6"


def test_the_kernel_takes_contiguous_fp32_targets_with_half_addends_on_the_gpu_only():
    target, addend = torch.zeros(4, 6), torch.ones(4, 6, dtype=torch.bfloat16)
    assert not grad_accumulate._kernel_takes(target, addend)  # CPU tensors

    class OnGpu(torch.Tensor):  # reports CUDA without a GPU, for the predicate alone
        @property
        def is_cuda(self):
            return True

    gpu_target, gpu_addend = target.as_subclass(OnGpu), addend.as_subclass(OnGpu)
    assert grad_accumulate._kernel_takes(gpu_target, gpu_addend)
    assert not grad_accumulate._kernel_takes(gpu_target, gpu_addend.float())  # fp32 addend: add_ is vectorized
    assert not grad_accumulate._kernel_takes(gpu_target.bfloat16(), gpu_addend)  # a bf16 main_grad
    assert not grad_accumulate._kernel_takes(gpu_target.t(), gpu_addend.t())  # not contiguous
    assert not grad_accumulate._kernel_takes(gpu_target[:2], gpu_addend)  # shapes differ


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_calls_off_the_kernel_are_torchs_add(dtype):
    generator = torch.Generator().manual_seed(3)
    target = torch.randn(3, 5, 7, generator=generator)
    addend = torch.randn(3, 5, 7, generator=generator).to(dtype)
    want = target.clone().add_(addend)
    assert grad_accumulate.accumulate_(target, addend) is target
    assert torch.equal(target, want)
