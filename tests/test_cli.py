"""The `skyrl-megatron` command from the venv: help, and bad input that fails fast and writes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CLI = shutil.which("skyrl-megatron", path=str(Path(sys.executable).parent)) or "skyrl-megatron"


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(cwd))  # the host's defaults write under $HOME: make that visible
    return subprocess.run([CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["trainer.strategy=megatorn"], "trainer.strategy: unknown strategy 'megatorn'"),
        (["trainer.policy.model.path=null"], "trainer.policy.model.path: no model path is set"),
        (["trainer.policy.megatron_config.tensor_model_parallel_size=3"], "not divisible by TP*PP*CP = 3*1*1 = 3"),
        (["trainer.policy.megatron_config.ddp_config.overlap_grad_reduc=true"], "did you mean 'overlap_grad_reduce'"),
    ],
)
def test_bad_input_exits_nonzero_with_one_paragraph_and_writes_nothing(tmp_path, hf_config_dir, args, expected):
    work = tmp_path / "work"
    work.mkdir()
    model = hf_config_dir()
    before = sorted(p for p in tmp_path.rglob("*"))
    out = run_cli([f"trainer.policy.model.path={model}", *args], work)
    assert out.returncode == 2, out.stderr[-2000:]
    message = [line for line in out.stderr.splitlines() if line.startswith("skyrl-megatron:")]
    assert len(message) == 1 and expected in message[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no outputs/, no ckpt or export dirs, no logs
