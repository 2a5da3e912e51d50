"""bench/rl_step_bench.py through skyrl 0.4's trainer (the CPU smoke run): the bench's settings reach this host
(ignore_eos through `additional_kwargs`, since 0.4 takes no new keys) and its step is reported whole. The same run on
skyrl-train 0.3.1, with every phase checked: tests/host03/test_rl_step_bench_host.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rl_step_bench.py"


@pytest.mark.slow
def test_smoke_run_through_skyrl04s_trainer(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(BENCH), "--smoke", "--strategies", "megatron", "--steps", "2", "--out", str(out),
               "--workdir", str(tmp_path / "work")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads((out / "rl_step.json").read_text())
    assert report["versions"]["host"] == "skyrl"
    result = report["strategies"]["megatron"]
    assert (result["exit"], result["complete"], result["measured_steps"], result["losses_finite"]) == (0, True, 2, True)
    # every reply max_tokens long: ignore_eos reached our engine through the host's additional_kwargs
    shape = report["settings"]["shape"]
    assert result["generated_tokens"] == shape["prompts"] * shape["samples"] * shape["max_tokens"] == 64
    for name in ("generate", "fwd_logprobs_values_reward", "policy_train", "sync_weights", "step"):
        assert all(seconds > 0 for seconds in result["phases"][name]["seconds"]), name
    assert result["train_inference_gap"] < 1e-3  # the engine sampled with the weights the policy then scored
