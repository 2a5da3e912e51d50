"""`bench/gpu_master_weights_check.py` (the GPU timing of compact master weights' release and rebuild):
its smoke mode runs on CPU, and its exactness check fails when a rebuild is wrong."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_master_weights_check.py"


def test_smoke_mode_times_and_checks_the_eager_kernels(tmp_path, bench_smoke):
    out = tmp_path / "mw.json"
    run = bench_smoke(SCRIPT, out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tensors"] == 19 and [r["kernels"] for r in report["runs"]] == ["eager"]
    assert report["runs"][0]["exact"] and report["runs"][0]["freed_gib"] > 0


def test_a_wrong_rebuild_fails_the_check(tmp_path, bench_smoke):
    out = tmp_path / "mw.json"
    patch = ("import dataclasses; real = script.master_weights._EAGER; script.master_weights._EAGER = dataclasses.replace("
             "real, join=lambda upper, remainder: real.join(upper, remainder) ^ 1)")
    run = bench_smoke(SCRIPT, out, patch)
    assert run.returncode == 1 and not json.loads(out.read_text())["runs"][0]["exact"]
