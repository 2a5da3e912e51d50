"""The 4-GPU MoE proof (bench/gpu_moe_proof.py) run on CPU: 4 gloo ranks, a tiny MoE of the same
structure, fp32. Checks the script before device time is spent on it, and asserts in fp32 what the
GPU run shows in bf16: EP4 and TP2 x EP2 give EP1's logprobs before and after two training steps,
and an EP4 checkpoint reloaded under TP2 x EP2 (model, distributed optimizer, scheduler) takes the
next step exactly as the EP4 run that never stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_moe_proof_script_on_cpu(tmp_path):
    out = tmp_path / "moe.json"
    env = {**os.environ, "MOE_PROOF_CPU": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_moe_proof.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    summary = json.loads(out.read_text())

    assert summary["training_moved_logprobs_EP1"]["max_abs_diff"] > 1e-3  # the steps did something
    for name in ("EP4", "TP2xEP2"):
        layout = summary["layouts"][name]
        assert layout["logprobs_before_vs_EP1"]["max_abs_diff"] < 1e-5, name
        assert layout["logprobs_after_vs_EP1"]["max_abs_diff"] < 1e-5, name
        for ours, reference in zip(layout["steps"], summary["layouts"]["EP1"]["steps"]):
            assert ours["loss"] == pytest.approx(reference["loss"], abs=1e-5)
            assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)

    checkpoint = summary["checkpoint"]
    assert checkpoint["reloaded_vs_EP4_logprobs"]["max_abs_diff"] < 1e-5
    loss, grad_norm = checkpoint["one_more_step_loss"], checkpoint["one_more_step_grad_norm"]
    assert loss["reloaded"] == pytest.approx(loss["EP4"], abs=1e-6)
    assert grad_norm["reloaded"] == pytest.approx(grad_norm["EP4"], rel=1e-6)
    # the extra step moved the policy, and both runs moved it the same way (the Adam moments came back)
    assert checkpoint["moved_by_the_extra_step"]["max_abs_diff"] > 1e-3
    assert checkpoint["after_one_more_step_logprobs"]["max_abs_diff"] < 1e-5
