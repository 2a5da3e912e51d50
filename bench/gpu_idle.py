"""Where the GPU waits: idle gaps between kernels in a torch profile, and what the host did then.

Operator tables say how long kernels ran, not when the GPU had nothing to do. This walks the
profile's device intervals, merges them, and attributes every gap between them to the host
operation that was running at the gap's midpoint: the innermost operator on the thread where one
is running (the autograd engine runs backward on its own thread), labelled with the first frame of
its Python stack from our code, Megatron or the host (when the profile was taken with
`with_stack=True`, which slows the host further) and with the innermost marked range. Gaps shorter than `min_gap_us` are counted, not attributed: they are
launch latency between back-to-back kernels, which only fewer or larger kernels remove.

Ranges opened with `torch.profiler.record_function` under the `skyrl_megatron.` prefix (the runner
marks its phases) are reported with their wall time and the device time inside them.

A profiled step runs slower than an unprofiled one (the profiler adds host time to every operator),
so the idle time it shows is an upper bound; where it sits is what the report is for.

`write_profile_report` writes one profiled step's report (this analysis and the top operators), the same for
our workers and the plain FSDP2 loop in bench/policy_bench.py.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

FRAME_MARKERS = ("skyrl_megatron/", "megatron/", "skyrl_train/", "policy_bench")
NOT_DEVICE_WORK = frozenset({"Command Buffer Full"})


@dataclass(frozen=True)
class HostOp:
    name: str
    start_us: float
    end_us: float
    thread: int
    frame: str = ""


@dataclass
class IdleReport:
    span_us: float = 0.0
    busy_us: float = 0.0
    small_gaps_us: float = 0.0
    small_gaps: int = 0
    attributed: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    ranges: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0, 0]))

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us

    def render(self, top: int = 25) -> str:
        ms = 1e-3
        lines = self._render_idle(top) if self.span_us > 0 else ["no device activity recorded"]
        if self.ranges:
            lines += ["", "marked ranges (record_function)", f"{'wall ms':>9} {'busy ms':>9} {'calls':>6}  range"]
            for name, (wall, busy, count) in sorted(self.ranges.items(), key=lambda kv: -kv[1][0]):
                lines.append(f"{wall * ms:9.1f} {busy * ms:9.1f} {int(count):6d}  {name}")
        return "\n".join(lines) + "\n"

    def _render_idle(self, top: int) -> list[str]:
        ms = 1e-3
        lines = [
            f"device span {self.span_us * ms:.1f} ms: kernels busy {self.busy_us * ms:.1f} ms "
            f"({100 * self.busy_us / self.span_us:.0f}%), idle {self.idle_us * ms:.1f} ms; of the idle time "
            f"{self.small_gaps_us * ms:.1f} ms in {self.small_gaps} short gaps (launch latency)",
            "",
            "idle time by what the host was running (longer gaps)",
            f"{'idle ms':>9} {'gaps':>6}  host operation @ first frame of ours / Megatron / host",
        ]
        for key, (idle, count) in sorted(self.attributed.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"{idle * ms:9.1f} {int(count):6d}  {key}")
        return lines


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class _ThreadOps:
    """One thread's host operations, to find the innermost one running at a time."""

    def __init__(self, ops: list[HostOp]):
        self.ops = sorted(ops, key=lambda op: op.start_us)
        self.starts = [op.start_us for op in self.ops]

    def innermost_at(self, t: float, max_scan: int = 2000) -> HostOp | None:
        # nested operators start later than their parents, so the latest-starting operator that is
        # still running at t is the innermost one
        i = bisect.bisect_right(self.starts, t) - 1
        for j in range(i, max(-1, i - max_scan), -1):
            if self.ops[j].end_us >= t:
                return self.ops[j]
        return None


def idle_report(
    kernels: list[tuple[float, float]],
    host_ops: list[HostOp],
    marked: list[HostOp] = (),
    min_gap_us: float = 50.0,
) -> IdleReport:
    report = IdleReport()
    busy = merge_intervals(kernels)
    starts = [start for start, _ in busy]
    for mark in marked:
        entry = report.ranges[mark.name]
        entry[0] += mark.end_us - mark.start_us
        entry[1] += _busy_within(busy, starts, mark.start_us, mark.end_us)
        entry[2] += 1
    if not busy:
        return report
    report.span_us = busy[-1][1] - busy[0][0]
    report.busy_us = sum(end - start for start, end in busy)
    by_thread: dict[int, list[HostOp]] = defaultdict(list)
    for op in host_ops:
        by_thread[op.thread].append(op)
    threads = [_ThreadOps(ops) for ops in by_thread.values()]
    ranges = _ThreadOps(list(marked))
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        gap = gap_end - gap_start
        if gap < min_gap_us:
            report.small_gaps_us += gap
            report.small_gaps += 1
            continue
        middle = (gap_start + gap_end) / 2
        running = [op for op in (t.innermost_at(middle) for t in threads) if op is not None]
        if running:
            op = max(running, key=lambda o: o.start_us)
            key = f"{op.name} @ {op.frame}" if op.frame else op.name
        else:
            key = "(no host operation recorded)"
        within = ranges.innermost_at(middle)
        if within is not None:
            key += f"  [in {within.name}]"
        entry = report.attributed[key]
        entry[0] += gap
        entry[1] += 1
    return report


def _busy_within(busy, starts, lo: float, hi: float) -> float:
    total = 0.0
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(busy) and busy[i][0] < hi:
        total += max(0.0, min(hi, busy[i][1]) - max(lo, busy[i][0]))
        i += 1
    return total


def first_frame(stack: list[str]) -> str:
    """The first stack entry in our code, Megatron or the host, from its package directory on."""
    for entry in stack or ():
        for marker in FRAME_MARKERS:
            at = entry.find(marker)
            if at >= 0:
                return entry[at:]
    return ""


def from_profiler(profiler, marked_prefix: str = "skyrl_megatron.") -> IdleReport:
    """The report of a finished `torch.profiler.profile`."""
    from torch.autograd import DeviceType

    kernels, host, marked = [], [], []
    for event in profiler.events():
        start, end = event.time_range.start, event.time_range.end
        if event.device_type == DeviceType.CUDA:
            # ranges mirrored onto the device timeline, and CUPTI's own records, are not work
            if not (event.is_user_annotation or event.name in NOT_DEVICE_WORK or event.name.startswith(marked_prefix)):
                kernels.append((start, end))
        elif event.name.startswith(marked_prefix):
            marked.append(HostOp(event.name, start, end, event.thread))
        elif not event.is_async:
            host.append(HostOp(event.name, start, end, event.thread, first_frame(event.stack)))
    return idle_report(kernels, host, marked)


def write_profile_report(profiler, wall_seconds: float, heading: str, out_file: str | None) -> dict[str, float]:
    """The summary of a finished torch profile (wall, device busy and idle seconds, host operator count) and, with
    `out_file`, its report there: the summary under `heading`, where the device waited, and the top operators by
    device time, by host time and by count."""
    import json
    from pathlib import Path

    import torch

    averages = profiler.key_averages()
    idle = from_profiler(profiler)
    summary = {"wall_seconds": wall_seconds, "device_busy_seconds": idle.busy_us / 1e6,
               "device_idle_seconds": idle.idle_us / 1e6,
               "host_ops": float(sum(e.count for e in averages if e.key.startswith("aten::")))}
    if out_file:
        sort_device = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        Path(out_file).write_text(
            f"{heading}: {json.dumps(summary)}\n\n"
            f"where the device waited\n{idle.render()}\n"
            f"top operators by device time\n{averages.table(sort_by=sort_device, row_limit=40)}\n"
            f"top operators by host time\n{averages.table(sort_by='self_cpu_time_total', row_limit=30)}\n"
            f"most frequent operators\n{averages.table(sort_by='count', row_limit=20)}\n"
        )
    return summary
