"""Device time of a call, read from two CUDA events around it: the bench scripts' shared timer."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_event_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
                    before: Callable[[], object] | None = None) -> float:
    """The median milliseconds of `fn()` between a CUDA event recorded before it and one after, over `repeats`
    calls that follow `warmup` untimed ones; `before` runs ahead of each timed call, outside the events (say, a
    barrier that lines the ranks up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
