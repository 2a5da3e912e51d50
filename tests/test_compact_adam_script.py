"""`bench/gpu_compact_adam_check.py` (today's optimizer step over compact masters against the one-pass step): its
smoke mode runs both on CPU, and its bitwise check against the eager definition fails when the step is wrong."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_compact_adam_check.py"


def test_smoke_mode_steps_both_sides_and_checks_the_one_pass(tmp_path, bench_smoke):
    out = tmp_path / "ca.json"
    run = bench_smoke(SCRIPT, out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["reference"]["bitwise"] and report["reference"]["elements_checked"] >= report["elements"]
    assert set(report["step_s"]) == {"chain", "one_pass"} and len(report["against_torch_adamw"]
                                                                  ["differing_masters_per_step"]) == 6
    # torch's AdamW and ours round apart, by far less than a step's size
    assert 0 < report["against_torch_adamw"]["max_abs_difference_over_lr"] < 1e-2


def test_a_wrong_update_fails_the_check(tmp_path, bench_smoke):
    out = tmp_path / "ca.json"
    # the one pass's step a tenth off in every scalar it reads
    patch = ("real = script.compact_adam.queue_run_step; script.compact_adam.queue_run_step = "
             "lambda *args: real(*args[:7], args[7] * 1.1, *args[8:])")  # the scalar table (lr among them) off
    run = bench_smoke(SCRIPT, out, patch)
    assert run.returncode == 1
    report = json.loads(out.read_text())
    assert not report["reference"]["bitwise"] and report["against_torch_adamw"]["max_abs_difference_over_lr"] > 1e-2
