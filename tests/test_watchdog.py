"""Hangs become named errors (`watchdog.py`): ranks of a gloo world, a watched call that one rank leaves
without joining the collective the others wait in.

Asserted, with `collective_timeout_s` of a few seconds (a hang would run into `run_on_ranks`' timeout,
far below torch's 30 minutes):
* the waiting ranks fail with one `CollectiveHang` naming the role, the phase and call, the rank that did
  not join (and where it is), the ranks waiting, and the timeout key; the same text reaches the
  driver's registry (here: a list); the calls before it pass untouched;
* a rank that comes late (after the others named it, before their process groups give up) ends the
  call normally, and the report is taken back;
* where the waiting call never fails by itself (NCCL's case: the process group ends the process instead
  of raising), the watchdog reports the hang and ends the process;
* a call failing for a reason of its own passes its error through unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_megatron.testing import DistributedTestError, run_on_ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0


def _one_rank_skips_a_collective(rank, world, timeout_s):
    import torch
    import torch.distributed as dist

    from skyrl_megatron.failures import CollectiveHang
    from skyrl_megatron.parallel import set_collective_timeout
    from skyrl_megatron.watchdog import CollectiveWatchdog

    store = dist.distributed_c10d._get_default_store()
    reports: list[str] = []
    withdrawn: list[str] = []

    def report(message: str) -> None:
        reports.append(message)
        store.set(f"reported by {rank}", "yes")

    watchdog = CollectiveWatchdog("policy workers", timeout_s, report=report, withdraw=withdrawn.append)
    set_collective_timeout(watchdog.group_timeout())
    for _ in range(2):
        with watchdog.watch("scoring"):
            dist.all_reduce(torch.ones(1))
    # a late rank: it comes once the others have named it (before their process groups give up)
    if rank == 1:
        store.wait(["reported by 0", "reported by 2"])
    with watchdog.watch("weight sync"):
        dist.all_reduce(torch.ones(1))
    late = {"reports": list(reports), "withdrawn": list(withdrawn)}
    reports.clear()
    try:
        with watchdog.watch("training"):
            if rank != 1:
                dist.all_reduce(torch.ones(1))
        error = None
    except CollectiveHang as hang:
        error = str(hang)
    try:
        with watchdog.watch("scoring"):
            raise ValueError("a bad batch")
    except ValueError as own:
        own_error = f"{type(own).__name__}: {own}"
    _leave_together(world)
    return {"error": error, "reports": reports, "own_error": own_error, "late": late}


def _leave_together(world: int) -> None:
    """Wait (on the store, the group is broken) until every rank is done: a rank that exits closes its
    connections, which would fail the others' calls for that reason instead."""
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    for key in ("done", "seen"):  # rank 0 serves the store: it leaves last
        store.add(key, 1)
        while (key == "done" or dist.get_rank() == 0) and store.add(key, 0) < world:
            time.sleep(0.05)


def test_a_rank_that_skips_a_collective_fails_the_call_naming_it():
    results = run_on_ranks(_one_rank_skips_a_collective, 3, TIMEOUT_S, timeout=90)
    assert results[1]["error"] is None  # the rank that skipped left its call normally
    expected = ("policy workers: training call #1 is stuck in a collective: rank 1 did not join it within "
                f"megatron_config.collective_timeout_s={TIMEOUT_S:g} s (rank 1 finished training call #1 without "
                "joining; it has since finished scoring call #3); waiting in it: ranks 0, 2")
    for rank in (0, 2):
        assert results[rank]["error"] == expected
        assert results[rank]["reports"] == [expected]
    for result in results:
        assert result["own_error"] == "ValueError: a bad batch"
    # the late rank was named by the two waiting ranks, and the report taken back when it came
    late = ("policy workers: weight sync call #1 is stuck in a collective: rank 1 did not join it within "
            f"megatron_config.collective_timeout_s={TIMEOUT_S:g} s (rank 1 never entered weight sync call #1; "
            "it last finished scoring call #2); waiting in it: ranks 0, 2")
    assert [results[rank]["late"] for rank in (0, 2)] == [{"reports": [late], "withdrawn": [late]}] * 2
    assert results[1]["late"] == {"reports": [], "withdrawn": []}


def _stuck_where_the_group_never_fails(rank, world, timeout_s, report_file):
    """Rank 0 waits (outside any collective, as a rank blocked on an NCCL kernel does) for rank 1, which
    left the call: the process group never fails the call, so the watchdog must end the process."""
    import time

    from skyrl_megatron import watchdog as watchdog_module
    from skyrl_megatron.watchdog import CollectiveWatchdog

    watchdog_module._EXIT_AFTER_S = 1.0
    watchdog = CollectiveWatchdog("critic workers", timeout_s,
                                  report=lambda message: Path(report_file).write_text(message))
    with watchdog.watch("weight sync"):
        if rank == 0:
            time.sleep(120)
    time.sleep(9 if rank == 1 else 0)  # rank 1 stays up until rank 0 is gone
    return "left"


def test_a_call_stuck_outside_the_process_groups_ends_its_process(tmp_path):
    from skyrl_megatron.watchdog import EXIT_CODE

    report_file = tmp_path / "report.txt"
    with pytest.raises(DistributedTestError, match=f"rank 0.*exit code {EXIT_CODE}"):
        run_on_ranks(_stuck_where_the_group_never_fails, 2, TIMEOUT_S, str(report_file), timeout=90)
    assert report_file.read_text() == (
        "critic workers: weight sync call #1 is stuck in a collective: rank 1 did not join it within "
        f"megatron_config.collective_timeout_s={TIMEOUT_S:g} s (rank 1 finished weight sync call #1 without "
        "joining); waiting in it: rank 0")
