"""The dense MLP with fc1 and its SwiGLU as one GEMM in forward-only passes (`fused_kernels: [swiglu_gemm]`).

`SwiGLUGemmMLP` is Megatron-Core's `MLP` with `SwiGLUGemmFc1` as its `linear_fc1` (put in the layer spec by
`layer_spec._with_swiglu_gemm`). In a forward-only pass (`forward_only.active()`), where the kernel takes the
operands, fc1 returns silu(gate) * up from `swiglu_gemm.fc1_swiglu` and the MLP goes straight to fc2; every other
call (training, a recomputed layer, a bias, a clamp, per-token scales, LoRA's wrapper around fc1, operands the
kernel does not take) runs Megatron's own forward. The fused call goes through fc1's `__call__`, so the hooks DDP
puts on it (the wait for its parameters' all-gather) run as before.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self.swiglu_epilogue_applies = (
            c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.add_bias_linear
            and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
            and not c.use_te_activation_func
            and c.fp8 is None
            and getattr(c, "fp4", None) is None
        )

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        fc1 = self.linear_fc1
        if (
            per_token_scale is None
            and self.swiglu_epilogue_applies
            and forward_only.active()
            and isinstance(fc1, SwiGLUGemmFc1)
            and fc1.takes_swiglu_epilogue(hidden_states)
        ):
            intermediate, _ = fc1(hidden_states, swiglu_epilogue=True)
            return self.linear_fc2(intermediate)
        return super().forward(hidden_states, per_token_scale, **kwargs)


def has_swiglu_gemm(modules) -> bool:
    """Whether any of `modules` is an MLP that can take the fused call."""
    return any(isinstance(m, SwiGLUGemmMLP) and m.swiglu_epilogue_applies for m in modules)


__all__ = ["SwiGLUGemmFc1", "SwiGLUGemmMLP", "has_swiglu_gemm"]
