"""Passes through Megatron's pipeline schedules (no PP, 1F1B, interleaved VPP alike)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from skyrl_megatron.model.layers.forward_only import forward_only_pass


def forward_only(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[Any],
    forward_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    collect_fn: Callable[[torch.Tensor, Any], Any],
    *,
    seq_length: int,
    micro_batch_size: int,
) -> list[Any]:
    """Run `forward_fn` over every micro-batch through the pipeline; on the last stage return
    `collect_fn(output, micro_batch)` per micro-batch, in order (elsewhere an empty list). Layers see the pass as
    forward-only (`model.layers.forward_only`): no backward follows it.

    `forward_fn(model_chunk, micro_batch)` returns the chunk's output; on inner stages Megatron feeds
    the received activations through `set_input_tensor`, so the same function serves every stage.
    """

    def make_collect(micro_batch):
        def collect(output_tensor, non_loss_data=False):
            return collect_fn(output_tensor, micro_batch)

        return collect

    with torch.no_grad(), forward_only_pass():
        return _run(
            chunks,
            micro_batches,
            forward_fn,
            make_collect,
            forward_only=True,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
        )


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[Any],
    forward_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict]],
    *,
    seq_length: int,
    micro_batch_size: int,
) -> list[dict]:
    """Forward and backward over every micro-batch; gradients accumulate in the DDP buffers and the
    model config's `finalize_model_grads_func` runs once at the end (Megatron calls it).

    `loss_fn(output, micro_batch)` returns `(loss, metrics)` on the last stage. Megatron divides that
    loss by the number of micro-batches and multiplies it by the CP size; callers that want a
    different normalisation scale their loss accordingly. Returns the metrics per micro-batch on the
    last stage (elsewhere an empty list).
    """

    def make_loss(micro_batch):
        def loss(output_tensor):
            return loss_fn(output_tensor, micro_batch)

        return loss

    return _run(
        chunks,
        micro_batches,
        forward_fn,
        make_loss,
        forward_only=False,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
    )


def _run(chunks, micro_batches, forward_fn, make_tail, *, forward_only, seq_length, micro_batch_size):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        return forward_fn(model, micro_batch), make_tail(micro_batch)

    # with virtual pipeline stages each chunk walks the same micro-batches with its own iterator
    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    return list(
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=list(chunks) if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )
    )
