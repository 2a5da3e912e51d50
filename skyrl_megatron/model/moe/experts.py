"""Grouped-GEMM MoE experts without Transformer Engine.

Megatron-Core's local (TE-free) spec runs a layer's experts one after another (`SequentialMLP`: a
host sync, a split and two small GEMMs per expert). Its `TEGroupedMLP` runs all local experts of a
layer as two grouped GEMMs, but only its linear layers need TE: the module takes them from its spec
(`GroupedMLPSubmodules.linear_fc1/linear_fc2`, any builder with the `GroupedLinearFc1Builder`
signature) and its non-fused forward is plain PyTorch. This module supplies those two linears on
PyTorch's grouped matrix multiplication (`torch._grouped_mm`: CUTLASS kernels on Hopper, a loop of
matmuls on CPU), so `moe_grouped_gemm: true` (Megatron-Bridge's default for MoE checkpoints) gives
grouped experts with or without TE, on GPU and in the CPU runtime alike.

Parameters are named as TE's `GroupedLinear` names them (`weight0` ... `weight{E-1}`, each
[out, in] of one local expert), so Megatron-Bridge's `linear_fc{1,2}.weight*` mappings, `TEGroupedMLP`'s
checkpoint layout (interchangeable with `SequentialMLP`'s) and our exports apply unchanged.

The expert weights are stacked into one [E, out, in] operand per GEMM; where they lie back to back
in memory (as Megatron DDP's buffers place them, see `_GroupedLinear`) the stack is a view,
otherwise a copy made in the forward and again in the backward, never kept alive in between. Weight
gradients come out of one grouped GEMM and, under gradient-accumulation fusion, are added into
DDP's fp32 `main_grad` buffers with one add per back-to-back run (one in all, as DDP lays them out; on
GPU a vectorized kernel, `grad_accumulate.py`, where PyTorch's mixed-dtype add is not).

Where DDP's per-parameter hooks have nothing to do for them (fusion on, `overlap_grad_reduce` off:
`model/build.py` says so through `_GroupedLinear.grads_bypass_autograd`), the weights do not enter
autograd at all: the stack goes in as one detached tensor and the backward adds into `main_grad` itself.
Otherwise every expert weight is an autograd input with its own AccumulateGrad node and DDP hook, run
for a placeholder gradient in every micro-batch (at Qwen3-30B-A3B widths: 2,048 per micro-batch for 8
layers, 337 ms of host time in an H200 training step). Passes without autograd (scoring) skip the
Function. Which expert tensors lie back to back is remembered per layer by their data pointers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from skyrl_megatron.model.layers import forward_only, swiglu_gemm
from skyrl_megatron.model.moe import expert_gemm, expert_wgrad
from skyrl_megatron.model.moe.grad_accumulate import accumulate_

logger = logging.getLogger(__name__)

# torch._grouped_mm needs every operand's strides, but the unit one, to be multiples of 16 bytes.
_ALIGNMENT_BYTES = 16


def _aligned(*tensors: Tensor) -> bool:
    """Whether the kernel takes these operands. Judged by strides, not by the last dimension: the
    weight gradient's `grad_output.t()` is a transposed view whose last dimension is the routed token
    count (any number) while its memory rows are `out` wide."""
    return all(
        stride * t.element_size() % _ALIGNMENT_BYTES == 0 for t in tensors for stride in t.stride() if stride != 1
    )


def back_to_back_runs(tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
    """Maximal [start, end) index runs of same-shaped tensors that lie back to back in one storage."""
    runs, start = [], 0
    for i in range(1, len(tensors) + 1):
        if i < len(tensors):
            prev, cur = tensors[i - 1], tensors[i]
            if (
                prev.is_contiguous()
                and cur.is_contiguous()
                and cur.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                and cur.storage_offset() == prev.storage_offset() + prev.numel()
            ):
                continue
        runs.append((start, i))
        start = i
    return runs


def _run_view(tensors: Sequence[Tensor]) -> Tensor:
    """[n, rows, cols] view over back-to-back [rows, cols] tensors."""
    first = tensors[0]
    rows, cols = first.shape
    return first.as_strided((len(tensors), rows, cols), (rows * cols, cols, 1), first.storage_offset())


def stacked_weights(weights: Sequence[Tensor], runs: list[tuple[int, int]] | None = None) -> Tensor:
    """[E, out, in] over the experts' [out, in] weights: a view where they lie back to back, else a copy.

    `runs` is `back_to_back_runs(weights)` where the caller knows it already."""
    if (runs if runs is not None else back_to_back_runs(weights)) == [(0, len(weights))]:
        return _run_view(weights)
    return torch.stack(list(weights))


class _LayoutMemo:
    """`back_to_back_runs` of a list of tensors, recomputed only when their data pointers change.

    Equal pointers mean an equal layout: the tensors are live, so no two of them overlap, and a
    remembered run whose tensors now lie in separate storages would make `_run_view` step past its
    first tensor's storage, which `as_strided` refuses. Offloading and reloading parameters moves them,
    changing the pointers. (A Python loop over 128 experts costs 150 us; the pointers 18 us.)
    """

    def __init__(self):
        self._pointers: tuple[int, ...] = ()
        self._runs: list[tuple[int, int]] = []

    def runs(self, tensors: Sequence[Tensor]) -> list[tuple[int, int]]:
        pointers = tuple(t.data_ptr() for t in tensors)
        if pointers != self._pointers:
            self._pointers, self._runs = pointers, back_to_back_runs(tensors)
        return self._runs


def _grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """torch._grouped_mm, or its definition as a loop of matmuls where the kernel's alignment rules fail
    (the loop reads the offsets on the host: a device sync on GPU, for unaligned feature sizes only).

    2-D x 3-D: rows of `a` split by `offsets` (cumulative ends), group g times b[g].
    2-D x 2-D: the shared inner dimension split by `offsets`, one [m, n] product per group.
    """
    if _aligned(a, b):
        try:
            return torch._grouped_mm(a, b, offs=offsets)
        except RuntimeError:
            if a.is_cuda:
                raise
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


def _expert_rows_mm(a: Tensor, b: Tensor, offsets: Tensor, on_quack: bool) -> Tensor:
    """Expert g's rows of `a` times b[g] ([E, K, N]): quack's varlen-M GEMM where `on_quack` (`expert_gemm`) and it
    takes the operands, else `_grouped_mm`."""
    if on_quack and expert_gemm.takes(a, b):
        return expert_gemm.matmul(a, b, offsets)
    return _grouped_mm(a, b, offsets)


class _GroupedLinearFunction(torch.autograd.Function):
    """y = x_g @ W_g^T per expert g; the stacked weights are rebuilt in backward rather than saved."""

    @staticmethod
    def forward(ctx, x: Tensor, offsets: Tensor, fuse_wgrad: bool, on_quack: bool, *weights: Tensor) -> Tensor:
        ctx.fuse_wgrad, ctx.on_quack = fuse_wgrad, on_quack
        ctx.save_for_backward(x, offsets, *weights)
        return _expert_rows_mm(x, stacked_weights(weights).transpose(1, 2), offsets, on_quack)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, offsets, *weights = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _expert_rows_mm(grad_output, stacked_weights(weights), offsets, ctx.on_quack)
        grad_weights: list[Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[4:]):
            grad_weights = list(_weight_gradients(x, grad_output, offsets, weights, ctx.fuse_wgrad))
        return grad_input, None, None, None, *grad_weights


def _add_into(targets: Sequence[Tensor], grads: Tensor, runs: list[tuple[int, int]]) -> None:
    """targets[g] += grads[g] ([E, out, in]), one mixed-dtype add per back-to-back run of DDP's buffer
    (a vectorized kernel on GPU: `grad_accumulate`)."""
    for start, end in runs:
        accumulate_(_run_view(targets[start:end]), grads[start:end])


def _weight_gradients(x: Tensor, grad_output: Tensor, offsets: Tensor, weights: Sequence[Tensor], fuse: bool):
    """Per-expert dW = dY_g^T X_g from one grouped GEMM; under fusion added into `main_grad` directly."""
    fused = fuse and all(hasattr(w, "main_grad") for w in weights)
    # torch._grouped_mm writes its inputs' dtype only (no fp32 output for bf16 inputs, torch 2.11)
    grads = _grouped_mm(grad_output.t(), x, offsets)  # [E, out, in]
    if not fused:
        return grads.unbind(0)
    main_grads = [w.main_grad for w in weights]
    _add_into(main_grads, grads, back_to_back_runs(main_grads))
    # Megatron's DDP hook skips the add for a parameter marked this way; the returned gradient is
    # a placeholder AccumulateGrad needs (one allocation for all experts, never read).
    placeholder = torch.empty_like(grads, dtype=weights[0].dtype)
    for w in weights:
        if hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
    return placeholder.unbind(0)


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """y = x_g @ W_g^T with the weights outside autograd: the backward adds dW into `main_grad` itself.

    `stacked_weight` is a detached [E, out, in] view of the layer's weights (back to back, so saving
    it keeps nothing extra alive); autograd sees only `x`, so it builds no edge, AccumulateGrad node
    or DDP hook per expert weight.
    """

    @staticmethod
    def forward(ctx, x: Tensor, offsets: Tensor, stacked_weight: Tensor, layer: "_GroupedLinear") -> Tensor:
        ctx.layer, ctx.on_quack = layer, layer.gemm_on_quack
        ctx.save_for_backward(x, offsets, stacked_weight)
        return _expert_rows_mm(x, stacked_weight.transpose(1, 2), offsets, ctx.on_quack)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, offsets, stacked_weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_input = _expert_rows_mm(grad_output, stacked_weight, offsets, ctx.on_quack)
        ctx.layer.add_weight_gradients(grad_output, x, offsets)
        return grad_input, None, None, None


TokenCounts = Sequence[int] | Tensor  # tokens per local expert: a host list, or a tensor (on the device: no sync)


def expert_offsets(tokens_per_expert: TokenCounts, device: torch.device) -> Tensor:
    """The grouped GEMM's `offs` on `device`: each expert's cumulative row end, int32.

    From a tensor the sum runs where the tensor lies, so counts already on the device never visit
    the host; a host list (or host tensor) is summed there and copied over, as before.
    """
    if isinstance(tokens_per_expert, Tensor):
        ends = tokens_per_expert.to(torch.int64).cumsum(0).to(torch.int32)
    else:
        ends = torch.tensor(list(tokens_per_expert), dtype=torch.int64).cumsum(0).to(torch.int32)
    return ends if ends.device == device else ends.to(device, non_blocking=True)


def grouped_linear(
    x: Tensor,
    tokens_per_expert: TokenCounts,
    weights: Sequence[Tensor],
    fuse_wgrad: bool = False,
    on_quack: bool = False,
) -> Tensor:
    """Expert g's rows of `x` (consecutive, `tokens_per_expert[g]` of them) times weights[g]^T; `on_quack`: the
    forward and input-gradient GEMMs through `expert_gemm` where it takes them."""
    offsets = expert_offsets(tokens_per_expert, x.device)
    return _GroupedLinearFunction.apply(x, offsets, fuse_wgrad, on_quack, *weights)


class _GroupedLinear(torch.nn.Module):
    """The local experts' weights of one linear layer of an MoE block, applied as one grouped GEMM.

    Built through `TEGroupedMLP`'s `GroupedLinearFc1Builder` signature. Expert tensor parallelism
    shards each expert's weight like Megatron's column/row parallel linears (`partition_dim`); the
    token dispatcher does the communication, so the layer itself has none.
    """

    partition_dim: int  # 0: column parallel (fc1), 1: row parallel (fc2)
    tensor_model_parallel = True  # read by Megatron-Bridge to split weights the right way

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection=None,
        name: str | None = None,
    ):
        super().__init__()
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu, set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        if bias:
            raise ValueError(
                "grouped experts without Transformer Engine have no bias: set "
                "transformer_config_kwargs.moe_grouped_gemm=false for expert layers with a bias"
            )
        assert is_expert, "grouped linears hold MoE experts only"
        self.config = config
        self.num_local_experts = num_local_experts
        self.tp_group = pg_collection.expt_tp
        self.ep_group = pg_collection.ep
        self.dp_group = pg_collection.expt_dp
        tp_size = self.tp_group.size()
        if self.partition_dim == 0:
            output_size //= tp_size
        else:
            input_size //= tp_size
        self.in_features, self.out_features = input_size, output_size
        # gradient_accumulation_fusion is only on where DDP gives parameters a main_grad (build.py)
        self.fuse_wgrad = bool(config.gradient_accumulation_fusion)
        self.grads_bypass_autograd = False  # set by build.py where DDP's hooks need no gradient
        self.wgrad_in_gemm = False  # set by build.py where `moe_config.expert_gemms` picks quack (expert_wgrad.py)
        self.gemm_on_quack = False  # set by build.py where `moe_config.expert_gemms` picks quack (expert_gemm.py)
        self._weight_layout, self._main_grad_layout = _LayoutMemo(), _LayoutMemo()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        # Registered last to first: Megatron DDP lays its param and grad buffers out in reverse
        # registration order, so the experts' weights and main_grads then run back to back in
        # expert order and the grouped GEMM reads (and accumulates into) them without a copy.
        for index in reversed(range(num_local_experts)):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
            if config.perform_initialization:
                if config.use_cpu_initialization:
                    set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init_method(weight)
                else:
                    _initialize_affine_weight_gpu(weight, init_method, self.partition_dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
            weight.allreduce = False  # reduced over the expert-data-parallel group
            self.register_parameter(f"weight{index}", weight)

    def expert_weights(self) -> list[Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_local_experts)]

    def forward(self, x: Tensor, tokens_per_expert: TokenCounts) -> tuple[Tensor, None]:
        weights = self.expert_weights()
        runs = self._weight_layout.runs(weights)
        if not torch.is_grad_enabled():
            offsets = expert_offsets(tokens_per_expert, x.device)
            stacked = stacked_weights(weights, runs)
            return _expert_rows_mm(x, stacked.transpose(1, 2), offsets, self.gemm_on_quack), None
        if self._weights_bypass_autograd(x, weights, runs):
            offsets = expert_offsets(tokens_per_expert, x.device)
            stacked = stacked_weights(weights, runs).detach()
            return _GroupedLinearIntoMainGrad.apply(x, offsets, stacked, self), None
        return grouped_linear(x, tokens_per_expert, weights, self.fuse_wgrad, self.gemm_on_quack), None

    def _weights_bypass_autograd(self, x: Tensor, weights: list[Tensor], runs: list[tuple[int, int]]) -> bool:
        """Whether this pass may keep the weights out of autograd: their gradients go to `main_grad`
        and nothing else waits for them, and the backward will run (it needs `x` to want a gradient)."""
        return (
            self.grads_bypass_autograd
            and self.fuse_wgrad
            and weights[0].requires_grad
            and hasattr(weights[0], "main_grad")
            and x.requires_grad
            and runs == [(0, len(weights))]
        )

    def add_weight_gradients(self, grad_output: Tensor, x: Tensor, offsets: Tensor) -> None:
        """main_grad of expert g += dY_g^T X_g: inside one GEMM where `wgrad_in_gemm` is set and the main grads
        lie back to back (`expert_wgrad`), else a grouped GEMM in the weights' dtype and an fp32 add."""
        main_grads = [w.main_grad for w in self.expert_weights()]
        runs = self._main_grad_layout.runs(main_grads)
        if self.wgrad_in_gemm and runs == [(0, len(main_grads))]:
            target = _run_view(main_grads)
            if expert_wgrad.takes(target, grad_output, x):
                expert_wgrad.add_(target, grad_output, x, offsets)
                return
        _add_into(main_grads, _grouped_mm(grad_output.t(), x, offsets), runs)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """One ShardedTensor per local expert under the global expert axis, as `SequentialMLP` lays them out."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        num_global = self.ep_group.size() * self.num_local_experts
        first_global = self.ep_group.rank() * self.num_local_experts
        singleton = (metadata or {}).get("singleton_local_shards", False)
        out = {}
        for index, weight in enumerate(self.expert_weights()):
            global_index = first_global + index
            if singleton:
                offsets, expert_prefix = sharded_offsets, f"{global_index}.{prefix}"
            else:
                offsets = (*sharded_offsets, (len(sharded_offsets), global_index, num_global))
                expert_prefix = prefix
            local = make_sharded_tensors_for_checkpoint(
                {f"{index}.weight": weight},
                "",
                {f"{index}.weight": self.partition_dim},
                offsets,
                tp_group=self.tp_group,
                dp_cp_group=self.dp_group,
            )
            replace_prefix_for_sharding(local, f"{index}.", expert_prefix)
            out[f"{prefix}weight{index}"] = local[f"{index}.weight"]
        return out


class ColumnGroupedLinear(_GroupedLinear):
    """fc1 of every local expert (gate and up rows for SwiGLU), split over expert-TP by output rows.

    Asked with `swiglu_probs` (forward-only passes, `GroupedExperts`), it returns the experts' weighted activation
    silu(gate) * up * prob, fc1's GEMM and the SwiGLU in one quack gated GEMM (`expert_gemm.fc1_swiglu`). Expert-TP
    keeps [gate; up] halves on every rank, as the dense fc1 does."""

    partition_dim = 0

    def stacked_weight(self) -> Tensor:
        weights = self.expert_weights()
        return stacked_weights(weights, self._weight_layout.runs(weights))

    def takes_swiglu_epilogue(self, x: Tensor) -> bool:
        """Whether the fused call runs `x` (the experts' permuted rows)."""
        return expert_gemm.takes_fc1_swiglu(x, self.stacked_weight())

    def forward(self, x: Tensor, tokens_per_expert: TokenCounts, swiglu_probs: Tensor | None = None):
        if swiglu_probs is None:
            return super().forward(x, tokens_per_expert)
        out = expert_gemm.fc1_swiglu(x, self.stacked_weight(), expert_offsets(tokens_per_expert, x.device))
        # each row's routing probability, multiplied in fp32 and rounded: a rounding after the activation's own, as
        # Megatron's unfused activation has (its fused one weights before it rounds)
        return out.mul_(swiglu_probs.unsqueeze(-1)), None


class RowGroupedLinear(_GroupedLinear):
    """fc2 of every local expert, split over expert-TP by input columns."""

    partition_dim = 1


class _CountsKeptOnDevice:
    """tokens_per_expert handed through `TEGroupedMLP.forward` as the tensor it is.

    Megatron's non-fused forward turns the counts into a host list (`tokens_per_expert.tolist()`, a
    device-to-host sync on GPU) only to pass that list on to its linears (and to the bias and FP8
    paddings, which grouped experts without TE never take); ours read the counts as a tensor.
    """

    def __init__(self, counts: Tensor):
        self.counts = counts

    def tolist(self) -> Tensor:
        return self.counts


_grouped_experts_class = None


def grouped_experts_class():
    """`GroupedExperts`: Megatron's TEGroupedMLP whose linears take the token counts as a tensor.

    A subclass rather than a patch of `TEGroupedMLP.forward`: its forward runs Megatron's unchanged
    (activation, probabilities, recompute, offloading), the counts passed as they came. Where the
    dispatcher kept them on the device (`model/moe/layer.py`, EP1), the grouped GEMMs' offsets are
    summed there, and no step of the experts waits for the device. Counts the dispatcher copied to
    the host (EP > 1) are summed on the host and copied over, as before. Megatron-Bridge's
    per-expert LoRA adapters take either form (they read a tensor with `.tolist()`: with LoRA on the
    experts that read remains). Not a forward of our own: Megatron's is long (activation fusion,
    recompute, offloading) and stays right as it changes; only the one conversion is skipped.
    Built on first use (Megatron is imported late).
    """
    global _grouped_experts_class
    if _grouped_experts_class is None:
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        class GroupedExperts(TEGroupedMLP):
            def __init__(self, *args, swiglu_in_gemm: bool = False, **kwargs):
                super().__init__(*args, **kwargs)
                # fc1 and the SwiGLU in one GEMM in forward-only passes (`fused_kernels: [swiglu_gemm_experts]`)
                self.swiglu_in_gemm = swiglu_in_gemm and swiglu_epilogue_applies(self.config)

            def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **buffers):
                if (
                    self.swiglu_in_gemm
                    and not buffers
                    and forward_only.active()
                    and isinstance(self.linear_fc1, ColumnGroupedLinear)
                    and self.linear_fc1.takes_swiglu_epilogue(permuted_local_hidden_states)
                ):
                    weighted, _ = self.linear_fc1(permuted_local_hidden_states, tokens_per_expert,
                                                  swiglu_probs=permuted_probs)
                    output, _ = self.linear_fc2(weighted, tokens_per_expert)
                    return output, None
                if isinstance(tokens_per_expert, Tensor):
                    tokens_per_expert = _CountsKeptOnDevice(tokens_per_expert)
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **buffers)

        GroupedExperts.__module__ = __name__
        _grouped_experts_class = GroupedExperts
    return _grouped_experts_class


def swiglu_epilogue_applies(config) -> bool:
    """Whether the experts' activation is the plain SwiGLU (`swiglu_gemm.plain_swiglu`) weighted by the routing
    probability after it (what the fused call computes): besides, no interleaving, no probabilities on the input and
    no activation offloading."""
    return (
        swiglu_gemm.plain_swiglu(config)
        and getattr(config, "moe_mlp_glu_interleave_size", None) is None
        and not config.moe_apply_probs_on_input
        and not getattr(config, "fine_grained_activation_offloading", False)
    )


def has_swiglu_gemm(modules) -> bool:
    """Whether any of `modules` is a grouped experts module that takes the fused call."""
    return any(getattr(m, "swiglu_in_gemm", False) for m in modules)


def grouped_linears(chunks) -> list[_GroupedLinear]:
    """The grouped experts' linears of `chunks` (none in a dense model, or where LoRA keeps per-expert linears)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, _GroupedLinear)]


def keep_expert_weights_out_of_autograd(chunks) -> int:
    """Let the grouped linears of DDP-wrapped `chunks` add their weight gradients into `main_grad`
    outside autograd (see the module doc). Only for a DDP config without `overlap_grad_reduce`: with it,
    DDP's per-parameter hook marks each gradient ready for the overlapped reduce and must run.
    Returns how many linears were set."""
    linears = grouped_linears(chunks)
    for linear in linears:
        linear.grads_bypass_autograd = True
    return len(linears)


def add_weight_gradients_in_gemm(chunks) -> int:
    """Let the grouped linears of `chunks` that keep their weights out of autograd and have fp32 main grads (DDP's
    `grad_reduce_in_fp32`) add dW into `main_grad` inside the GEMM (`expert_wgrad`, quack's varlen-K GEMM).
    Returns how many linears were set."""
    linears = [
        m for m in grouped_linears(chunks)
        if m.grads_bypass_autograd and all(w.main_grad.dtype == torch.float32 for w in m.expert_weights())
    ]
    for linear in linears:
        linear.wgrad_in_gemm = True
    return len(linears)


def run_gemms_on_quack(chunks) -> int:
    """Let every grouped linear of `chunks` run its forward and input-gradient GEMMs on quack's varlen-M GEMM
    (`expert_gemm`). Returns how many linears were set."""
    linears = grouped_linears(chunks)
    for linear in linears:
        linear.gemm_on_quack = True
    return len(linears)


def grouped_experts_builder(swiglu_in_gemm: bool = False):
    """The experts entry of a local MoE layer spec: `GroupedExperts` (TEGroupedMLP) over our grouped linears;
    `swiglu_in_gemm`: fc1 and the SwiGLU as one GEMM in forward-only passes (`fused_kernels: [swiglu_gemm_experts]`;
    the caller decides that quack runs)."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

    _register_with_bridge()
    import functools

    return functools.partial(
        grouped_experts_class(),
        submodules=GroupedMLPSubmodules(linear_fc1=ColumnGroupedLinear, linear_fc2=RowGroupedLinear),
        swiglu_in_gemm=swiglu_in_gemm,
    )


def _register_with_bridge() -> None:
    """Tell Megatron-Bridge's automatic mappings how our linears are split (it keys on class names)."""
    try:
        from megatron.bridge.models.conversion.param_mapping import AutoMapping
    except ImportError:  # the bridge is optional for building a model from a provider
        return
    AutoMapping.register_module_type(ColumnGroupedLinear.__name__, "column")
    AutoMapping.register_module_type(RowGroupedLinear.__name__, "row")
