"""bench/device_jobs.sh, the detached jobs of a GPU machine session: they run one after another, a failed job does
not stop the next, a poll reports each job's state and exit status and packs logs and results into $OUT."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "device_jobs.sh"


def _call(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120,
                          cwd=SCRIPT.parents[1])


def test_jobs_run_in_order_and_a_poll_packs_their_results(tmp_path):
    env = {**os.environ, "JOBS": str(tmp_path / "jobs"), "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    started = _call("start", "echo first > $JOBS/out/first.txt; sleep 1", "echo failing; exit 3",
                    "cat $JOBS/out/first.txt; echo third", env=env)
    assert started.returncode == 0 and "3 job(s) started" in started.stdout, started.stderr
    again = _call("start", "true", env=env)  # refused while the first jobs run
    assert again.returncode == 1 and "still running" in again.stderr

    polled = _call("poll", "60", env=env)
    assert polled.returncode == 0, polled.stderr
    out = polled.stdout
    assert "== job 1 (exit 0)" in out and "== job 2 (exit 3)" in out and "== job 3 (exit 0)" in out
    assert "failing" in out and "first\nthird" in out  # the third ran after the first, despite the second
    assert "all done" in out
    with tarfile.open(tmp_path / "out" / "jobs.tgz") as packed:
        names = set(packed.getnames())
    assert {"jobs/out/first.txt", "jobs/job_2.log", "jobs/job_2.rc", "jobs/ALL_DONE"} <= names


def test_a_poll_before_any_start_says_so(tmp_path):
    env = {**os.environ, "JOBS": str(tmp_path / "none")}
    polled = _call("poll", "1", env=env)
    assert polled.returncode == 1 and "nothing started" in polled.stderr
