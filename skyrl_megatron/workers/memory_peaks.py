"""The accelerator memory a worker's phases peaked at, for comparing the memory planner with a run.

Each scoring or training call is measured from a reset of the allocator's peak counters; a summary
keeps the largest peak of each phase since it was last drained (the demo drains it once per step).
The reset is process-wide: whoever reads `torch.cuda.max_memory_allocated()` across several of a
worker's phases sees the last phase's peak only, so read this summary instead (`bench/policy_bench.py`
does; until 2026-11-27 it read the counter and reported the optimizer step's peak as training's).
On CPU there is no device allocator to read, and the summary stays empty.
"""

from __future__ import annotations

import contextlib

import torch


class PhasePeaks:
    def __init__(self):
        self._peaks: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def measure(self, phase: str):
        if not torch.cuda.is_available():
            yield
            return
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            seen = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
            kept = self._peaks.setdefault(phase, dict.fromkeys(seen, 0.0))
            for key, value in seen.items():
                kept[key] = max(kept[key], value)

    def drain(self) -> dict[str, float]:
        """``{"<phase>_peak_allocated_gib": ..., "<phase>_peak_reserved_gib": ...}`` since the last drain."""
        peaks, self._peaks = self._peaks, {}
        return {f"{phase}_{key}": value for phase, figures in peaks.items() for key, value in figures.items()}
