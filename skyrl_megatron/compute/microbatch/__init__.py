"""From the host's padded RL rows to Megatron micro-batches, one way, one file per step.

`pipeline.prepare_micro_batches` calls the steps in this order; none calls back into an earlier one::

    rows.py              the host's [B, S] rows: where each row's real tokens are (RowSpans), next-token labels
    plan.py              which rows go together (row count or token budget), how many micro-batches every
                         rank runs (PP/EP agreement, VPP rounding, empty padding ones) and their shape
    inputs.py            model inputs of one micro-batch: padded rows or one packed (THD) row
    context_parallel.py  this CP rank's shard of the model inputs (Megatron's load-balanced split)
    targets.py           what the model call scores and follows: logprob targets, real-token mask, MoE routes
    pipeline.py          the steps in order -> a `MicroBatch` per micro-batch, which `ModelRunner` consumes

`model_inputs.py` is the type the steps pass on (with its maps between the host's columns and the
model layout, the packed row's included); `results.py` is the way back (per-token outputs -> the host's
columns), apart from the forward path. Each step owns its layout arithmetic (`plan.py` the packing
alignment, `inputs.py` the THD packing); the context-parallel split is the model's layout
(`model/layers/context_parallel_layout.py`, also read by the core attention), below all of them.

This package's `__init__` imports nothing, so importing one step does not import the others.
"""
