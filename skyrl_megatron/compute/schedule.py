"""Forward passes through Megatron's pipeline schedules (no PP, 1F1B, interleaved VPP alike)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


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
    `collect_fn(output, micro_batch)` per micro-batch, in order (elsewhere an empty list).

    `forward_fn(model_chunk, micro_batch)` returns the chunk's output; on inner stages Megatron feeds
    the received activations through `set_input_tensor`, so the same function serves every stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        output = forward_fn(model, micro_batch)

        def collect(output_tensor, non_loss_data=False):
            return collect_fn(output_tensor, micro_batch)

        return output, collect

    # with virtual pipeline stages each chunk walks the same micro-batches with its own iterator
    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    with torch.no_grad():
        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=list(chunks) if len(chunks) > 1 else chunks[0],
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=True,
                collect_non_loss_data=True,
            )
        )
