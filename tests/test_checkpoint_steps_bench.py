"""bench/checkpoint_steps.py: the save-step arithmetic over a run's per-step metrics, and what a failed run leaves."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "bench"


@pytest.fixture(scope="module")
def checkpoint_steps():
    sys.path.insert(0, str(BENCH_DIR))  # bench/ is not a package: its modules import each other by name
    try:
        return importlib.import_module("checkpoint_steps")
    finally:
        sys.path.remove(str(BENCH_DIR))


def _write_metrics(path: Path, steps: int, interval: int, *, normal: float = 4.0, save: float = 5.0,
                   offload_after: int = 0) -> None:
    """A demo's metrics.jsonl: an eval record first (no global step), then one record per step; step 1 is slow
    (warm-up) and the first save slower still. The offload after a save is recorded `offload_after` steps later."""
    lines = [json.dumps({"step": 0, "eval/accuracy": 0.1})]
    for step in range(1, steps + 1):
        seconds = save if step % interval == 0 else normal
        if step == 1:
            seconds = 30.0
        if step == interval:
            seconds = 60.0
        record = {"step": step, "trainer/global_step": step, "timing/step": seconds + step * 0.01,
                  "offload/policy_offload_s": 1.0, "offload/policy_allocated_gib_after_offload": 0.06}
        if step % interval == 0:
            record["timing/save_checkpoints"] = seconds - normal
            record["timing/checkpoint_capture"] = 0.3
        if step % interval == offload_after:
            # the offload after a save parks most of the state in the save's host copies
            record.update({"offload/policy_offload_s": 0.25, "offload/policy_offload_lent_gib": 37.5})
        if step == interval + 1:
            record["offload/policy_allocated_gib_after_offload"] = 15.1  # a save's device tensors held a step on
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")


def test_save_step_medians_leave_out_the_warm_ups_and_the_last_step(checkpoint_steps, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, steps=10, interval=3)
    result = checkpoint_steps.step_times(metrics, interval=3, steps=10)
    assert result["save_steps"] == [6, 9] and result["first_save"]["step"] == 3
    assert result["plain_steps"] == [2, 4, 5, 7, 8]
    assert result["normal_step_s"] == pytest.approx(4.05)  # median of 4.02, 4.04, 4.05, 4.07, 4.08
    assert result["save_step_s"] == pytest.approx(5.075)  # median of 5.06 and 5.09
    assert result["save_step_overhead"] == pytest.approx(5.075 / 4.05 - 1)
    assert result["save_breakdown_s"]["checkpoint_capture"] == pytest.approx(0.3)
    assert result["offload_s"] == {"after_saves": 0.25, "other_steps": 1.0} and result["offload_lent_gib"] == 37.5
    assert result["allocated_gib_after_offload"] == 15.1
    row = checkpoint_steps.table({"async": {**result, "run_s": 1.0}}).splitlines()[-1]
    assert row.endswith("| 0.25 / 1.00 | 37.50 |"), row


def test_the_offload_after_a_save_is_read_from_the_step_that_recorded_it(checkpoint_steps, tmp_path):
    """skyrl-train 0.3.1 records the offload that follows a save in the next step's metrics."""
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, steps=10, interval=3, offload_after=1)
    result = checkpoint_steps.step_times(metrics, interval=3, steps=10)
    assert result["offload_s"] == {"after_saves": 0.25, "other_steps": 1.0} and result["offload_lent_gib"] == 37.5


def test_a_run_too_short_for_two_saves_is_refused_with_the_fix(checkpoint_steps, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, steps=6, interval=3)
    with pytest.raises(SystemExit, match="--steps 6, --ckpt-interval 3"):
        checkpoint_steps.step_times(metrics, interval=3, steps=6)


def test_metrics_are_kept_with_the_count_of_finished_steps(checkpoint_steps, tmp_path):
    metrics, kept = tmp_path / "run" / "metrics.jsonl", tmp_path / "out" / "async_metrics.jsonl"
    metrics.parent.mkdir()
    kept.parent.mkdir()
    assert checkpoint_steps.keep_metrics(metrics, kept) == 0 and not kept.exists()
    _write_metrics(metrics, steps=5, interval=3)
    assert checkpoint_steps.keep_metrics(metrics, kept) == 5  # the eval record is not a step
    assert kept.read_text() == metrics.read_text()


def test_a_failed_run_names_its_log_and_the_steps_it_finished(checkpoint_steps, tmp_path, monkeypatch):
    """The demo refuses an unknown key before any work: the bench stops with the mode, the exit code and where the
    log and the metrics are, and the next mode does not start."""
    out, work = tmp_path / "out", tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["checkpoint_steps.py", "--cpu", "--out", str(out), "--workdir", str(work),
                                      "--modes", "async,sync", "--steps", "4", "--ckpt-interval", "2",
                                      "trainer.policy.megatron_config.no_such_key=1"])
    with pytest.raises(SystemExit, match=r"async run failed \(exit 2\) after 0 finished step\(s\); see .*async\.log"):
        checkpoint_steps.main()
    assert "no_such_key" in (out / "async.log").read_text()
    assert not (out / "sync.log").exists()
    assert (work / "async").is_dir()  # the run lived under --workdir
