"""Megatron-Core's multi-tensor optimizer ops on PyTorch's foreach kernels, where neither TE nor Apex is installed.

Without Transformer Engine or Apex, Megatron's gradient clipping (`optimizer/clip_grads.py`) and its
mixed-precision optimizer (`optimizer/optimizer.py`) fall back to `megatron.core.utils`'s local ops:
the l2 norm takes one norm per tensor and reads every one of them on the host
(`torch.tensor(list_of_device_scalars)`: a device sync per gradient), and the scale (which also copies
the fp32 main params into the bf16 model params after every step) launches two kernels per tensor. A
MoE model has thousands of parameter tensors (Qwen3-30B-A3B's 8-layer bench model: about 2,100), so one
optimizer step waited on the device about 2,100 times, twice (our step checks the norm before
Megatron's `step()` computes it again); an H200 profile of 2026-11-27 shows the step 70% idle.

PyTorch's `_foreach_norm`, `_foreach_mul_` and `_foreach_copy_` do the same arithmetic in a few
multi-tensor launches and read nothing on the host. `install()` puts them in place of Megatron's local
ops only, never over TE's or Apex's kernels, and gives Megatron the tensor-factor scale it otherwise
takes from TE: the gradient norm then stays on the device, as it does with TE. The results equal the
local ops' bitwise on CPU (tests/test_multi_tensor.py); the signatures are amp_C's, as Megatron calls
them through `multi_tensor_applier(op, noop_flag, tensor_lists, *args)`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def l2_norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], per_tensor: bool, *args):
    """The l2 norm over every tensor of `tensor_lists`, as a one-element fp32 tensor on `noop_flag`'s device."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    if len({t.device for t in tensors}) > 1:  # optimizer CPU offload: Megatron's op gathers on the host
        from megatron.core.utils import local_multi_tensor_l2_norm

        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    norms = torch._foreach_norm(tensors, 2)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.to(torch.float32).reshape(1), None


def scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], factor: float | Tensor) -> None:
    """dst = src * factor for each pair of `tensor_lists` = [sources, destinations] (a copy when factor is 1)."""
    sources, destinations = tensor_lists
    if not sources:
        return
    if isinstance(factor, Tensor):
        factor = factor.reshape(())  # Megatron's clip coefficient is [1]; the foreach ops take a 0-dim scalar
    if all(s is d for s, d in zip(sources, destinations)):
        torch._foreach_mul_(destinations, factor)
    elif not isinstance(factor, Tensor) and factor == 1.0:
        torch._foreach_copy_(destinations, sources)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, factor))


def install() -> list[str]:
    """Use the foreach ops wherever Megatron fell back to its local ones; returns the names replaced."""
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    replacements = {
        (clip_grads, "l2_norm_impl"): (megatron_utils.local_multi_tensor_l2_norm, l2_norm),
        (clip_grads, "multi_tensor_scale_impl"): (megatron_utils.local_multi_tensor_scale, scale),
        (megatron_optimizer, "multi_tensor_scale_impl"): (megatron_utils.local_multi_tensor_scale, scale),
    }
    replaced = []
    for (module, name), (local_op, foreach_op) in replacements.items():
        if getattr(module, name, None) is local_op:
            setattr(module, name, foreach_op)
            replaced.append(f"{module.__name__}.{name}")
    # With a scale that takes its factor as a tensor (TE's `multi_tensor_scale_tensor`), Megatron keeps the
    # gradient norm on the device: `get_grad_norm_fp32` returns a tensor and the clip multiplies by
    # min(1, max_norm / (norm + 1e-6)) computed there, so nothing is read before the update is queued.
    if clip_grads.l2_norm_impl is l2_norm and getattr(clip_grads, "multi_tensor_scale_tensor_impl", scale) is None:
        clip_grads.multi_tensor_scale_tensor_impl = scale
        replaced.append(f"{clip_grads.__name__}.multi_tensor_scale_tensor_impl")
    return replaced
