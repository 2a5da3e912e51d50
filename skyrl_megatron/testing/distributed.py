"""Run a function on N freshly spawned `torch.distributed` ranks and collect the results.

Megatron code only runs inside an initialized process group, and its parallel-state globals make
it unsafe to initialize twice in one process, so every multi-rank test needs real child processes.
`run_on_ranks` does that with the failure modes tests actually hit made visible: the traceback of
every rank that raised, the exit code of a rank that died silently, and the ranks that hung past
a hard timeout (which are killed, so a stuck collective never wedges the test session).

Ranks are forked from a server process (multiprocessing's "forkserver") that imported the heavy
libraries once (`testing/rank_preload.py`), instead of each starting a fresh interpreter: a rank
otherwise spends seconds importing before it runs anything. The server itself runs nothing, so each
rank still starts from a clean state; it gets the caller's current environment variables. NCCL ranks
(GPUs) are spawned instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist

THREADS_ENV_VAR = "SKYRL_MEGATRON_TEST_THREADS"

# After one rank fails (raises or dies), how long the others get to report. Peers of a failed rank are usually
# stuck in a collective that will never complete; waiting for the full timeout would only delay
# the report of the real error.
_FAILURE_GRACE_S = 10.0
# How long to wait for a terminated (SIGTERM) child before escalating to SIGKILL.
_TERMINATE_GRACE_S = 3.0
# Poll interval of the parent's wait loop; it bounds how late a silent death is noticed.
_POLL_S = 0.1
# Imported once by the rank server before it forks ranks (see the module docstring).
_PRELOAD = ["skyrl_megatron.testing.rank_preload"]


class DistributedTestError(RuntimeError):
    """One or more ranks raised, died without reporting, or hung past the timeout."""


@dataclass(frozen=True)
class _Report:
    """What a rank sends back: a pickled return value, or the text of its traceback."""

    rank: int
    ok: bool
    payload: bytes | str


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on `world_size` spawned ranks; return results by rank.

    `fn` must be a picklable top-level function, and so must its arguments and return value (CPU
    copies of returned tensors are sent back). Each rank re-imports `fn`'s module, so keep that
    module's import-time work light: it is paid once per rank. `timeout`, `backend` and `env` are
    consumed here and never reach `fn`. `env` entries are set in each child before the process
    group is created. Each child uses one intra-op thread so that N ranks do not oversubscribe a
    small CI machine; set ``SKYRL_MEGATRON_TEST_THREADS`` to change that.

    Raises `DistributedTestError` if any rank fails, or if the ranks are not all done `timeout`
    seconds after spawning (start-up included). Once one rank has failed, the others get a short
    grace period rather than the full timeout. No child outlives the call; on Linux children are
    also killed if the calling process itself dies.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # NCCL ranks are spawned: importing Megatron-Bridge in the rank server initialises CUDA on a GPU machine,
    # and CUDA does not survive a fork
    ctx = _rank_server() if backend == "gloo" else mp.get_context("spawn")
    reports: Queue = ctx.Queue()
    port = free_port()
    # the caller's environment as it is now: the rank server's own dates from the server's start
    inherited = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, inherited, dict(env or {}), args, kwargs, reports),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    start = time.monotonic()
    try:
        for proc in procs:
            proc.start()
        received, hung = _collect(procs, reports, timeout)
    finally:
        _stop(procs)
        reports.close()
    return _results_or_raise(received, procs, hung, time.monotonic() - start)


def _rank_server() -> mp.context.BaseContext:
    """The forkserver context; the server starts (and imports `_PRELOAD`) on the first rank's start."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def init_single_rank(device: str, port: int) -> None:
    """This process as the only rank of a process group ("cpu": gloo, "cuda": NCCL) with Megatron's parallel
    state at the default layout: for benchmarks that time one rank's work in the process that runs them."""
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    init_distributed(device)
    initialize_model_parallel(ParallelConfig(), seed=0)


def free_port() -> int:
    """Ask the OS for an unused TCP port for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    inherited: dict[str, str],
    env: dict[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reports: Queue,
) -> None:
    """Child entry point: set up the rank, run `fn`, report the result or the traceback."""
    try:
        _die_with_parent()
        os.environ.clear()
        os.environ.update(inherited)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        os.environ.update(env)
        torch.set_num_threads(int(os.environ.get(THREADS_ENV_VAR, "1")))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
            _stop_own_children()
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is reported as
        # this rank's error instead of being dropped and looking like a silent death.
        report = _Report(rank, True, pickle.dumps(_to_cpu(result)))
    except BaseException:  # noqa: BLE001 - the whole point is to ship any failure to the parent
        report = _Report(rank, False, traceback.format_exc())
    reports.put(report)


def _stop_own_children() -> None:
    """Stop helper processes `fn` left behind (e.g. the multiprocessing Manager that Megatron's
    checkpoint writer starts), which would otherwise outlive this rank as orphans."""
    for child in mp.active_children():
        child.terminate()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()


def _die_with_parent() -> None:
    """SIGKILL this rank once the process that called `run_on_ranks` is gone, so a killed test run leaves
    no orphans.

    The rank's parent process is the rank server, not the caller, and the server lives as long as any
    rank does, so the parent's death (prctl's PDEATHSIG) would never come. multiprocessing keeps a pipe
    from the caller to each child that closes only when the caller exits; a thread waits on it. A caller
    already gone when the thread starts ends the rank at once."""
    caller = mp.parent_process()
    if caller is None:
        return

    def watch() -> None:
        caller.join()  # returns when the caller's end of the pipe closes
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-caller", daemon=True).start()


def _to_cpu(value: Any) -> Any:
    """Detach and move tensors (also inside lists, tuples and dicts) to CPU for sending back."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if type(value) in (list, tuple):  # not subclasses: a namedtuple's constructor differs
        return type(value)(_to_cpu(item) for item in value)
    return value


def _collect(procs: list[BaseProcess], reports: Queue, timeout: float) -> tuple[dict[int, _Report], list[int]]:
    """Drain reports until every rank has reported or died, or time runs out.

    Reading while waiting (rather than joining first) matters: a child blocks on exit until the
    pipe has room for its report, so joining before reading deadlocks on large results.
    Returns the reports by rank and the ranks still running when the deadline passed.
    """
    deadline = time.monotonic() + timeout
    received: dict[int, _Report] = {}
    while True:
        _drain(reports, received, _POLL_S)
        pending = [rank for rank, proc in enumerate(procs) if rank not in received]
        if not pending:
            return received, []
        if all(not procs[rank].is_alive() for rank in pending):
            # A report is flushed before its sender exits; one last drain catches any in the pipe.
            _drain(reports, received, _POLL_S)
            return received, []
        some_rank_failed = any(not report.ok for report in received.values()) or any(
            not procs[rank].is_alive() for rank in pending
        )
        if some_rank_failed:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        if time.monotonic() >= deadline:
            return received, [rank for rank in pending if procs[rank].is_alive()]


def _drain(reports: Queue, received: dict[int, _Report], wait_s: float) -> None:
    """Move every queued report into `received`, waiting up to `wait_s` for the first one."""
    try:
        report = reports.get(timeout=wait_s)
        while True:
            received[report.rank] = report
            report = reports.get_nowait()
    except queue.Empty:
        return


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate, then kill, every child still alive, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _results_or_raise(
    received: dict[int, _Report], procs: list[BaseProcess], hung: list[int], waited_s: float
) -> list[Any]:
    """Return the unpickled results in rank order, or raise one error describing every failure."""
    failures = [
        _describe_failure(rank, received.get(rank), proc.exitcode, hung)
        for rank, proc in enumerate(procs)
        if rank not in received or not received[rank].ok
    ]
    if not failures:
        return [pickle.loads(received[rank].payload) for rank in range(len(procs))]
    summary = f"{len(failures)} of {len(procs)} rank(s) failed"
    if hung:
        summary += f"; ranks {hung} were still running after {waited_s:.1f}s and were killed"
    raise DistributedTestError("\n\n".join([summary, *failures]))


def _describe_failure(rank: int, report: _Report | None, exitcode: int | None, hung: list[int]) -> str:
    """One `rank N:` section: the traceback, the hang, or how the process ended without a word."""
    if report is not None:
        return f"rank {rank}:\n{report.payload}"
    if rank in hung:
        return f"rank {rank}: hung (still running at the deadline, killed)"
    return f"rank {rank}: exited without reporting a result ({_exit_reason(exitcode)})"


def _exit_reason(exitcode: int | None) -> str:
    """Spell out an exit code; multiprocessing reports death by signal N as -N."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
