"""From the host's padded RL rows to Megatron micro-batches, one way, one file per step.

`pipeline.prepare_micro_batches` calls the steps in this order, each once per micro-batch; a step
imports only the ones before it and never calls back into them::

    rows.py         the host's [B, S] rows: where each row's real tokens are (RowSpans), next-token labels
    plan.py         which rows go together (row count or token budget), how many micro-batches every
                    rank runs (PP/EP agreement, VPP rounding, empty padding ones), and each one's
                    layout: its shape, a packed row's sequence lengths (all the layout arithmetic)
    pack.py         every per-token tensor in the model layout: padded rows from column 0, or one
                    packed (THD) row; `ModelInputs` keeps the maps back to the host's columns
    shard.py        this rank's share: the CP rank's tokens (Megatron's load-balanced split), and the
                    routers' data in their order (the TP rank's slice under sequence parallelism)
    micro_batch.py  model inputs and targets on the device: the `MicroBatch` that `ModelRunner` runs

`results.py` is the way back (per-token outputs and recorded routes -> the host's columns), apart
from the forward path. The context-parallel split itself is the model's layout
(`model/layers/context_parallel_layout.py`, also read by the core attention), below all of them.

This package's `__init__` imports nothing, so importing one step does not import the others.
"""
