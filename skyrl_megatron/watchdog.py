"""Hangs turned into named errors: a watchdog on each scoring, training, weight-sync and checkpoint call.

A rank that died or skipped a collective leaves its peers waiting in it, and torch's only answer is the
process group's timeout, after which the waiting ranks fail (gloo) or are killed (NCCL) with a message
that names no rank. Here each worker records which call it is in, in the key-value store of its role's
default process group (its own TCP connection: a stuck collective does not block it):

    skyrl_megatron/watch/rank/<r>            "<phase> call #<n> in" or "... out": where rank r is
    skyrl_megatron/watch/rank/<r>/<phase>    the same, for its last call of that phase
    skyrl_megatron/watch/<phase>#<n>/in|out  how many ranks entered / left call n of the phase

Calls are counted per phase on every rank; the host calls every rank of a role, so call n is the same
call everywhere. A thread per worker watches a call once it has lasted `timeout_s`: if some rank is not
in it (it never came, or it left: it skipped a collective that the others wait in), on two looks in a
row, the call is stuck. The thread then names it, from every rank's record:

    policy workers: training call #3 is stuck in a collective: rank 1 did not join it within
    megatron_config.collective_timeout_s=600 s (rank 1 finished training call #3 without joining);
    waiting in it: rank 0

hands that to the driver's registry (`failures.report_failure`; the driver raises it as the run's error
even if this process is killed next), and keeps it for the call: the process groups give up
`grace_s` later (`group_timeout_s`), gloo by raising in the waiting call, which then raises
`CollectiveHang` with the message; NCCL by ending the process. Should the call still hang after that,
the thread ends the process itself, so the job never outlives the timeout by more than the grace.
A call that ends normally after all (the rank was late, not gone) takes its report back.

A call that fails on its own with a distributed error (a peer's connection closed: it died) is named
the same way when the records show ranks that are not in it; otherwise its error passes unchanged,
and the driver names dead processes (`failures.explain`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from skyrl_megatron.failures import CollectiveHang, report_failure, withdraw_failure

logger = logging.getLogger(__name__)

_PREFIX = "skyrl_megatron/watch"
# How long a stuck call's process may live on after the process groups should have failed it.
_EXIT_AFTER_S = 30.0
EXIT_CODE = 3  # the exit status of a worker process the watchdog ended
_DISTRIBUTED_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset)|process ?group|broken pipe", re.I)


@dataclass(frozen=True)
class Call:
    phase: str
    number: int

    def __str__(self) -> str:
        return f"{self.phase} call #{self.number}"


class CollectiveWatchdog:
    """One worker's watch over its calls (`watch`); every rank of the role's default group makes one."""

    def __init__(self, who: str, timeout_s: float, *, store=None, rank: int | None = None,
                 world_size: int | None = None, report: Callable[[str], None] = report_failure,
                 withdraw: Callable[[str], None] = withdraw_failure,
                 timeout_key: str = "megatron_config.collective_timeout_s"):
        self.who, self.timeout_s, self.timeout_key = who, float(timeout_s), timeout_key
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        self._report, self._withdraw = report, withdraw
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._call: Call | None = None
        self._call_timeout_s = self.timeout_s
        self._entered = 0.0
        self._verdict: str | None = None
        self._store_failed = False
        self._wake = threading.Event()
        self._store_op(self._store.set, self._rank_key(self.rank), "started")
        threading.Thread(target=self._watch_calls, name="collective-watchdog", daemon=True).start()

    # -- timing ------------------------------------------------------------------------------------

    @property
    def poll_s(self) -> float:
        return min(max(self.timeout_s / 8, 0.1), 5.0)

    @property
    def grace_s(self) -> float:
        """How long after the watchdog names a stuck call the process groups fail it."""
        return max(3.0, 0.1 * self.timeout_s) + 2 * self.poll_s

    def group_timeout(self, timeout_s: float | None = None) -> float:
        """The process groups' timeout for calls watched with `timeout_s` (default: the role's)."""
        return (self.timeout_s if timeout_s is None else timeout_s) + self.grace_s

    # -- calls -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, phase: str, timeout_s: float | None = None) -> Iterator[None]:
        """The block is call n of `phase` on this rank; calls inside it are part of it."""
        if self._call is not None:
            yield
            return
        self._counts[phase] += 1
        call = Call(phase, self._counts[phase])
        self._enter(call)
        with self._lock:
            self._call, self._entered, self._verdict = call, time.monotonic(), None
            self._call_timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        self._wake.set()
        try:
            yield
        except Exception as error:
            verdict = self._verdict
            if verdict is None and _DISTRIBUTED_FAILURE.search(f"{type(error).__name__} {error}"):
                verdict = self._roll_call(call, failed_with=error)
            if verdict is not None:
                raise CollectiveHang(verdict) from error
            raise
        else:
            if self._verdict is not None:  # the missing ranks came after all: no hang to report
                logger.warning("%s: %s ended after all; the report of it is withdrawn", self.who, call)
                self._withdraw(self._verdict)
        finally:
            with self._lock:
                self._call = None
            self._leave(call)

    def _record(self, call: Call, side: str) -> None:
        for key in (self._rank_key(self.rank), self._rank_key(self.rank, call.phase)):
            self._store_op(self._store.set, key, f"{call} {side}")

    def _enter(self, call: Call) -> None:
        self._record(call, "in")
        self._store_op(self._store.add, self._count_key(call, "in"), 1)
        if self.rank == 0 and call.number > 2:  # every rank left call n - 2 before any entered call n - 1
            old = Call(call.phase, call.number - 2)
            for side in ("in", "out"):
                with contextlib.suppress(Exception):  # tidying only (a store may not delete keys)
                    self._store.delete_key(self._count_key(old, side))

    def _leave(self, call: Call) -> None:
        self._store_op(self._store.add, self._count_key(call, "out"), 1)
        self._record(call, "out")

    # -- the thread ----------------------------------------------------------------------------------

    def _watch_calls(self) -> None:
        suspect: Call | None = None  # the call that looked stuck at the last look
        while True:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            with self._lock:
                call, entered, limit = self._call, self._entered, self._call_timeout_s
            if call is None or self._store_failed or time.monotonic() - entered < limit:
                suspect = None
                continue
            if self._everyone_in(call):
                suspect = None
            elif suspect == call:
                self._name_stuck_call(call, entered)
                suspect = None
            else:
                suspect = call

    def _everyone_in(self, call: Call) -> bool:
        entered = self._store_op(self._store.add, self._count_key(call, "in"), 0)
        left = self._store_op(self._store.add, self._count_key(call, "out"), 0)
        return entered is None or left is None or (entered >= self.world_size and left == 0)

    def _name_stuck_call(self, call: Call, entered: float) -> None:
        verdict = self._roll_call(call)
        if verdict is None:
            return
        with self._lock:
            if self._call != call:
                return  # it ended after all
            self._verdict = verdict
        logger.error("%s", verdict)
        self._report(verdict)
        deadline = time.monotonic() + self.grace_s + _EXIT_AFTER_S
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            if self._call != call:
                return  # the process group failed the call: its error names the hang
        logger.critical("%s; the call did not fail after the process groups' timeout: ending this process", verdict)
        os._exit(EXIT_CODE)

    # -- who is where ------------------------------------------------------------------------------

    def _roll_call(self, call: Call, failed_with: BaseException | None = None) -> str | None:
        """The message naming the ranks not in `call` (None when every rank is in it)."""
        here = f"{call} in"
        records = self._records(call.phase)
        if records is None:
            return None
        absent = {rank: record for rank, record in records.items() if record[0] != here}
        if not absent:
            return None
        waiting = [rank for rank, record in records.items() if record[0] == here]
        details = "; ".join(f"rank {rank} {_whereabouts(*record, call)}" for rank, record in absent.items())
        how = (f"failed in a collective ({type(failed_with).__name__}: {str(failed_with).strip().splitlines()[0][:200]})"
               if failed_with is not None else "is stuck in a collective")
        return (f"{self.who}: {call} {how}: {_ranks(absent)} did not join it within "
                f"{self.timeout_key}={self._call_timeout_s:g} s ({details}); waiting in it: {_ranks(waiting)}")

    def _records(self, phase: str) -> dict[int, tuple[str | None, str | None]] | None:
        """Each rank's (last call of `phase`, last call of any phase)."""
        records = {}
        for rank in range(self.world_size):
            record = []
            for key in (self._rank_key(rank, phase), self._rank_key(rank)):
                exists = self._store_op(self._store.check, [key])
                if exists is None:
                    return None
                record.append(self._store_op(self._store.get, key).decode() if exists else None)
            records[rank] = tuple(record)
        return records

    def _rank_key(self, rank: int, phase: str | None = None) -> str:
        return f"{_PREFIX}/rank/{rank}" + (f"/{phase}" if phase else "")

    @staticmethod
    def _count_key(call: Call, side: str) -> str:
        return f"{_PREFIX}/{call.phase}#{call.number}/{side}"

    def _store_op(self, op, *args):
        """A store operation; None once the store is unreachable (its server, rank 0's process, is gone):
        the watchdog then stands aside and the process groups' timeout remains."""
        if self._store_failed:
            return None
        try:
            return op(*args)
        except Exception as exc:  # noqa: BLE001 - reported once; training decides what happens next
            self._store_failed = True
            logger.warning("collective watchdog of %s rank %d: its store is unreachable (%s); calls are no longer "
                           "watched", self.who, self.rank, exc)
            return None


def _whereabouts(in_phase: str | None, latest: str | None, call: Call) -> str:
    """Where a rank that is not in `call` is, from its last call of the phase and its last call of any."""
    left = in_phase == f"{call} out"
    where = f"finished {call} without joining" if left else f"never entered {call}"
    if latest is None or latest == "started" or latest == in_phase:
        return where
    last, _, side = latest.rpartition(" ")
    if side == "in":
        return f"{where}; it is in {last} now"
    return f"{where}; it has since finished {last}" if left else f"{where}; it last finished {last}"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)
