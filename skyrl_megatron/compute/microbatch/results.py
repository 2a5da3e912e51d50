"""The way back: per-token outputs of a micro-batch's model call -> the host's columns.

Gathered over context parallelism into global token order, then mapped from the model layout to the
host's [B, S] columns; the response values are the columns predicting the last A tokens. Reads the
`MicroBatch` the forward path prepared; calls nothing of that path.
"""

from __future__ import annotations

import torch

from skyrl_megatron.compute.microbatch.micro_batch import MicroBatch
from skyrl_megatron.compute.route_replay import NO_ROUTE, RouteReplay, route_dtype


class _GatherContextParallel(torch.autograd.Function):
    """All-gather per-token values over CP into global token order.

    Every CP rank then computes the same loss on the whole sequences, so the gradient of a rank's
    own tokens is just its slice of the incoming gradient (no sum over ranks); Megatron's schedule
    multiplies the loss by the CP size and DDP averages over DP x CP, which together restore the
    full gradient.
    """

    @staticmethod
    def forward(ctx, local, split, group):
        ctx.split = split
        return split.gather(local, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.split.local(grad, dim=1), None, None


def response_columns(output: torch.Tensor, mb: MicroBatch, response_length: int) -> torch.Tensor:
    """[b, s(, k)] per-token outputs -> [rows, A(, k)]: the columns predicting the last A tokens."""
    if mb.cp_split is not None:
        from megatron.core import parallel_state as ps

        output = _GatherContextParallel.apply(output, mb.cp_split, ps.get_context_parallel_group())
    if output.dim() == 2:
        output = output.unsqueeze(-1)
    columns = [mb.inputs.to_host_columns(output[..., i]) for i in range(output.shape[-1])]
    per_column = torch.stack(columns, dim=-1)  # [rows, S, k]
    total = per_column.shape[1]
    return per_column[:, total - response_length - 1 : total - 1]


def collect(outputs: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, response_length: int, width: int):
    """(rows, values [rows, A, width]) per micro-batch -> [B, A, width] on the host."""
    result = torch.zeros(num_rows, response_length, width, dtype=torch.float32)
    for rows, values in outputs:
        result[rows] = values.cpu()
    return result


def recorded_host_routes(replay: RouteReplay, micro_batches: list[MicroBatch], batch_shape) -> torch.Tensor:
    """The routes recorded per micro-batch -> [B, S, L, k] in the host's columns (this rank's
    route layers; gathered over SP and CP, so every rank of a stage holds whole rows)."""
    from megatron.core import parallel_state as ps

    dtype = route_dtype(int(replay.config.num_moe_experts) - 1)
    out = torch.full((*batch_shape, replay.num_layers, replay.topk), NO_ROUTE, dtype=dtype)
    for mb in micro_batches:  # the same order on every rank: the gathers below pair up
        local_shape = mb.model_input_ids.shape
        recorded = torch.stack([mb.recorded[i] for i in range(replay.num_layers)], dim=1).long()  # [tokens, L, k]
        routes = mb.sp_slice.model_order(recorded, (local_shape[0], local_shape[1]), ps.get_tensor_model_parallel_group())
        if mb.cp_split is not None:
            routes = mb.cp_split.gather(routes, ps.get_context_parallel_group(), dim=1)
        if mb.rows.numel():
            out[mb.rows] = mb.inputs.to_host_layout(routes.cpu(), NO_ROUTE).to(dtype)
        mb.recorded = None
    return out
