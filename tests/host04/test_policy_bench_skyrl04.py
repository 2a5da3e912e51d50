"""bench/policy_bench.py on skyrl 0.4, whose trainer trains a step as `forward_backward` + `optim_step` per
mini-batch and reads the prompts' rows and the mini-batch boundaries from the batch's metadata: the CPU smoke run
(ours and the plain loop measured, the host's FSDP2 worker composed), and that worker's HF wrapper's attention.

The same harness on skyrl-train 0.3.1: tests/host03/test_policy_bench_host.py.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from test_policy_bench import BENCH, _bench_module


def test_the_hosts_hf_wrapper_loads_sdpa_without_flash_attn(tmp_path):
    """0.4's wrapper already picks SDPA where 0.3.1's picked eager: `fsdp2_sdpa` is the host's default on both, and
    the bench's eager-to-SDPA switch changes nothing here."""
    from skyrl_megatron import host_api
    from skyrl_megatron.activation import activate
    from skyrl_megatron.testing import make_tiny_hf_model

    activate()
    wrapper = importlib.import_module(host_api.hf_model_wrapper_module).HFModelWrapper
    make_tiny_hf_model("qwen3", tmp_path, seed=0)
    with _bench_module().hf_sdpa_for_eager():
        assert wrapper(str(tmp_path), use_flash_attention_2=False, bf16=False).model.config._attn_implementation == "sdpa"
    assert wrapper(str(tmp_path), use_flash_attention_2=False, bf16=False).model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_smoke_run_times_the_training_calls_of_skyrl04(tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCH), "--smoke", "--out", str(out),
               "--cases", "megatron:world1,fsdp2:world1,fsdp2_loop:world1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads(out.read_text())
    assert report["composed_only"] == ["fsdp2:world1"] and not report["failed"]
    assert report["host"].startswith("skyrl 0.4.")  # whose FSDP2 worker a ratio is against
    ours, loop = report["cases"]
    assert (ours["case"], loop["case"]) == ("megatron:world1", "fsdp2_loop:world1")
    for phase in ("forward", "train"):
        measured = ours["phases"][phase]
        # inside the worker: skyrl 0.4's forward_backward and optim_step added up, part of the driver's time
        assert len(measured["worker_seconds"]) == len(measured["seconds"]) == report["steps"]
        assert all(0 < w <= d for w, d in zip(measured["worker_seconds"], measured["seconds"]))
    # each step scores before it trains, so every ratio is 1 and both sides' loss is the advantages' token mean
    losses = {side: [float(line.rsplit("loss ", 1)[1]) for line in run.stdout.splitlines()
                     if line.strip().startswith(side + " step") and "loss " in line]
              for side in ("megatron:world1", "fsdp2_loop:world1")}
    assert len(losses["megatron:world1"]) == 4 and len(losses["fsdp2_loop:world1"]) == 3
    assert max(losses["megatron:world1"] + losses["fsdp2_loop:world1"]) - min(losses["megatron:world1"]) < 1e-4, losses
