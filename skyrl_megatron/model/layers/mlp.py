"""The dense MLP with fc1 and its SwiGLU as one GEMM (`fused_kernels: [swiglu_gemm]`, `swiglu_gemm_training`).

`SwiGLUGemmMLP` is Megatron-Core's `MLP` with `SwiGLUGemmFc1` as its `linear_fc1` (put in the layer spec by
`layer_spec._with_swiglu_gemm`). In a forward-only pass (`forward_only.active()`), where the kernel takes the
operands, fc1 returns silu(gate) * up from `swiglu_gemm.fc1_swiglu` and the MLP goes straight to fc2; every other
call (training, a recomputed layer, a bias, a clamp, per-token scales, LoRA's wrapper around fc1, operands the
kernel does not take) runs Megatron's own forward. The fused call goes through fc1's `__call__`, so the hooks DDP
puts on it (the wait for its parameters' all-gather) run as before.

`SwiGLUGemmTrainingMLP` (`swiglu_gemm_training`) takes the gated GEMM in every pass: passes without gradients as
above, training passes through `swiglu_gemm.SwiGLUMLPFunction` (fc1 and fc2 with the SwiGLU's forward and backward
in the GEMMs' epilogues), between Megatron's row-parallel reduction of fc2's output and the hooks DDP put on both
linears, run first as their `__call__` would. A model built with it scores and trains through the same arithmetic.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP
from torch import Tensor

from skyrl_megatron.model.layers import forward_only, swiglu_gemm


class SwiGLUGemmFc1(ColumnParallelLinear):
    """A SwiGLU MLP's fc1 that returns silu(gate) * up from one GEMM when its MLP asks (`swiglu_epilogue=True`)."""

    def takes_swiglu_epilogue(self, input_: Tensor) -> bool:
        """Whether the fused call runs `input_` [s, b, h] (this rank's sequence shard under sequence parallelism)."""
        if self.weight is None or self.gather_output or self.explicit_expert_comm or not input_.is_contiguous():
            return False
        return swiglu_gemm.takes(input_.view(-1, input_.shape[-1]), self.weight)

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None,
                swiglu_epilogue: bool = False):
        if not swiglu_epilogue:
            return super().forward(input_, weight, runtime_gather_output)
        if self.sequence_parallel:  # the rows of every rank's shard, as Megatron's fc1 gathers them
            input_ = gather_from_sequence_parallel_region(input_, group=self.tp_group)
        out = swiglu_gemm.fc1_swiglu(input_.view(-1, input_.shape[-1]), self.weight)
        return out.view(*input_.shape[:-1], out.shape[-1]), None


class SwiGLUGemmMLP(MLP):
    """Megatron-Core's dense MLP whose forward-only passes take fc1 and the SwiGLU from one GEMM."""

    in_training = False  # SwiGLUGemmTrainingMLP: every pass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swiglu_epilogue_applies = swiglu_gemm.plain_swiglu(self.config)

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        fc1 = self.linear_fc1
        if (
            per_token_scale is None
            and self.swiglu_epilogue_applies
            and isinstance(fc1, SwiGLUGemmFc1)
            and fc1.takes_swiglu_epilogue(hidden_states)
        ):
            if forward_only.active() or (self.in_training and not torch.is_grad_enabled()):
                intermediate, _ = fc1(hidden_states, swiglu_epilogue=True)
                return self.linear_fc2(intermediate)
            if self.in_training and self._fc2_takes_the_fused_backward():
                return self._trained_through_gated_gemms(hidden_states), None
        return super().forward(hidden_states, per_token_scale, **kwargs)

    def _fc2_takes_the_fused_backward(self) -> bool:
        fc2 = self.linear_fc2
        return (
            type(fc2) is RowParallelLinear
            and fc2.weight is not None
            and fc2.input_is_parallel
            and not fc2.explicit_expert_comm
            and not getattr(self.config, "delay_wgrad_compute", False)
        )

    def _trained_through_gated_gemms(self, hidden_states: Tensor) -> Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        for linear in (fc1, fc2):  # what their `__call__` would run first: DDP's wait for the parameters' all-gather
            for hook in linear._forward_pre_hooks.values():
                hook(linear, (hidden_states,))
        fuse = self.config.gradient_accumulation_fusion and all(hasattr(w, "main_grad") for w in (fc1.weight, fc2.weight))
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        partial = swiglu_gemm.SwiGLUMLPFunction.apply(rows, fc1.weight, fc2.weight, fuse, self.tp_group,
                                                      fc1.sequence_parallel)
        partial = partial.view(-1, *hidden_states.shape[1:-1], partial.shape[-1])
        if fc2.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        if self.tp_group.size() > 1:
            return reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return partial


class SwiGLUGemmTrainingMLP(SwiGLUGemmMLP):
    """`SwiGLUGemmMLP` that takes the gated GEMM in training passes too (`swiglu_gemm_training`)."""

    in_training = True


def has_swiglu_gemm(modules, in_training: bool = False) -> bool:
    """Whether any of `modules` is an MLP that can take the fused call (`in_training`: in training passes too)."""
    return any(isinstance(m, SwiGLUGemmMLP) and m.swiglu_epilogue_applies and (m.in_training or not in_training)
               for m in modules)


__all__ = ["SwiGLUGemmFc1", "SwiGLUGemmMLP", "SwiGLUGemmTrainingMLP", "has_swiglu_gemm"]
