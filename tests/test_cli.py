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


def test_help_shows_the_megatron_config(tmp_path):
    out = run_cli(["--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "skyrl-megatron" in out.stdout
    assert "megatron: critic, policy, ref" in out.stdout
    for key in ("tensor_model_parallel_size", "virtual_pipeline_model_parallel_size", "transformer_config_kwargs",
                "optimizer_config_kwargs", "ddp_config", "checkpoint_cache_dir", "lora_config"):
        assert key in out.stdout


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


def test_a_config_error_is_found_without_importing_torch_megatron_or_ray(hf_config_dir):
    """Heavy libraries load only after validation, so a bad config prints at once."""
    import subprocess
    import sys
    import textwrap

    probe = textwrap.dedent(
        f"""
        import sys
        from skyrl_megatron.cli import compose_config
        from skyrl_megatron.config import ConfigError
        from skyrl_megatron.validation import validate_config
        try:
            validate_config(compose_config(["trainer.policy.model.path={hf_config_dir()}",
                                            "trainer.policy.megatron_config.tensor_model_parallel_size=3"]))
        except ConfigError as err:
            print("caught", "TP*PP*CP" in str(err))
        print(sorted(m for m in ("torch", "megatron.core", "ray", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["caught True", "[]"], out.stdout


def test_a_bad_value_is_named_with_its_fix_before_torch_loads(run_python, hf_config_dir, bad_value):
    """The same line as skyrl 0.4 prints for it (tests/host04/test_skyrl04_config_errors.py), exit 2, no torch."""
    overrides, line = bad_value
    out = run_python("-m", "skyrl_megatron.cli", f"trainer.policy.model.path={hf_config_dir()}", *overrides)
    assert out.returncode == 2, out.stderr[-2000:]
    assert [m for m in out.stderr.splitlines() if m.startswith("skyrl-megatron:")] == [line], out.stderr[-2000:]
    assert not out.loaded("torch")
