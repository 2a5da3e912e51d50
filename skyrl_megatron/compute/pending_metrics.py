"""Metrics whose values are still on the device: their sums and collectives are queued, `read` waits for them.

A training call's metrics are read on the host. Read before the optimizer step, that read waits for the whole
backward pass, and the device then idles while the host prepares the step (the compact masters' rebuild, the
gradients handed to the main shards, the norm's gradient list: per-tensor Python work, thousands of tensors at MoE
widths). Read once the step is queued, the same values cost no wait of their own, and the step's host work runs
while the device finishes the backward pass.
"""

from __future__ import annotations

from typing import Callable


class PendingMetrics:
    """Metrics to read later: each reader returns its names and values (on the host) when called."""

    def __init__(self, *readers: Callable[[], dict[str, float]]):
        self._readers = readers

    def joined(self, other: "PendingMetrics") -> "PendingMetrics":
        return PendingMetrics(*self._readers, *other._readers)

    def read(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for reader in self._readers:
            metrics.update(reader())
        return metrics
