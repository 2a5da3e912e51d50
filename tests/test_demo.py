"""`make demo`'s job runs and its own checks pass (HF parity, TP=2+SP == world-1, exported weights)."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_and_its_checks_pass():
    out = subprocess.run(
        [sys.executable, "-m", "skyrl_megatron.demo", "--steps", "3"], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "logits vs HF before training" in out.stdout
    assert "trained weights exported under HF names" in out.stdout
