"""The GPU MoE sync check (bench/gpu_moe_sync_check.py) run on CPU in its smoke mode: a tiny model of
the same structure, fp32, the CPU probe in place of CUDA's sync debug mode. Checks the script before
device time is spent on it, and asserts what it asserts on GPU: every MoE layer keeps its counts on
the device and makes no sync, while the previous path waits once per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_moe_sync_check_script_on_cpu(tmp_path):
    out = tmp_path / "sync.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_moe_sync_check.py"), "--smoke", "--repeats", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["moe_layers"] == 4
    assert result["dispatchers"] == ["DeviceCountsDispatcher"]
    assert result["layer_sync_check"]["new"] == []
    old = result["layer_sync_check"]["old"]
    assert sorted({s["layer"] for s in old}) == [0, 1, 2, 3]  # the previous path waits in every layer
    assert all("synchronize" in s["what"] for s in old)
    assert result["step_syncs"]["in_moe_files"] == 0 and result["step_syncs"]["total"] > 0
    timing = result["timing"]
    assert set(timing) == {"old", "new", "speedup"} and timing["new"]["step_s"] > 0
