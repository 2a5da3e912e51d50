"""A bad value of ours on skyrl 0.4: the same line as on skyrl-train 0.3.1, printed before torch loads.

The host's full parse imports torch (its root post-init, about 4 s); our checks run first on its light
parse of the same overrides (`validation.validate_overrides`), and a good config still goes through the
full parse and every check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_megatron.cli import checked_config, compose_config
from skyrl_megatron.config import ConfigError
from skyrl_megatron.hosts.skyrl_0_4_config import SkyRLMegatronConfig
from skyrl_megatron.validation import validate_config, validate_overrides

MC = "trainer.policy.megatron_config"
BRIDGES = Path(__file__).resolve().parents[2] / "bench" / "vllm_bridges"


@pytest.fixture
def base(tmp_path, hf_config_dir):
    return ["trainer.strategy=megatron", f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.runtime=cpu",
            f"trainer.export_path={tmp_path}/export", f"trainer.ckpt_path={tmp_path}/ckpt"]


def _printed(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("skyrl-megatron:")]


def test_the_cli_names_a_bad_value_and_its_fix_before_torch_loads(run_python, hf_config_dir, bad_value):
    overrides, line = bad_value
    out = run_python("-m", "skyrl_megatron.cli", "trainer.strategy=megatron",
                     f"trainer.policy.model.path={hf_config_dir()}", *overrides)
    assert out.returncode == 2, out.stderr[-2000:]
    assert _printed(out.stderr) == [line], out.stderr[-2000:]
    assert not out.loaded("torch")


def test_the_demo_names_a_bad_value_and_its_fix_before_torch_loads(run_python, demo_run_dir):
    out = run_python("-m", "skyrl_megatron.demo", "--out", str(demo_run_dir), f"{MC}.runtime=gpu")
    assert out.returncode == 2, out.stderr[-2000:]
    assert _printed(out.stderr) == [
        f"skyrl-megatron: invalid skyrl-megatron config: {MC}.runtime: unknown runtime 'gpu'. Fix: use auto, cuda or cpu."]
    assert not out.loaded("torch")


def test_a_first_demo_run_names_a_bad_value_before_it_creates_its_model(run_python, tmp_path):
    run_dir = tmp_path / "fresh"
    out = run_python("-m", "skyrl_megatron.demo", "--out", str(run_dir), f"{MC}.runtime=gpu")
    assert out.returncode == 2, out.stderr[-2000:]
    assert _printed(out.stderr) == [
        f"skyrl-megatron: invalid skyrl-megatron config: {MC}.runtime: unknown runtime 'gpu'. Fix: use auto, cuda or cpu."]
    assert not out.loaded("torch") and not (run_dir / "model").exists()


def test_the_early_check_finds_what_the_full_parse_finds(base, bad_value):
    overrides, _ = bad_value
    with pytest.raises(ConfigError) as early:
        validate_overrides(base + overrides)
    with pytest.raises(ConfigError) as full:
        validate_config(compose_config(base + overrides), run_host_checks=False)
    assert str(early.value) == str(full.value)


def test_a_good_config_passes_the_early_check_and_gets_the_hosts_full_parse(base):
    cfg = checked_config(base + ["trainer.max_prompt_length=64"])
    assert type(cfg) is SkyRLMegatronConfig
    assert cfg.generator.max_input_length == 64  # the host's root post-init ran (it fills this in)
    assert cfg.trainer.algorithm.temperature == cfg.generator.sampling_params.temperature


def test_the_hosts_own_parse_rules_still_apply_after_the_early_check(base):
    """The host's root post-init rules are not part of the early check; the full parse still applies them."""
    with pytest.raises(ConfigError, match=r"\(command line\): data.dataloader.persistent_workers requires num_workers > 0"):
        checked_config(base + ["data.dataloader.persistent_workers=true", "data.dataloader.num_workers=0"])


def test_help_prints_the_usage_and_our_keys_before_torch_loads(run_python):
    """0.4's typed config would read ``--help`` as an unknown key: the command answers it itself."""
    out = run_python("-m", "skyrl_megatron.cli", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "The `skyrl-megatron` command" in out.stdout and "tensor_model_parallel_size" in out.stdout
    assert not out.loaded("torch")


def test_sampling_settings_without_a_host_key_reach_the_engines_as_additional_kwargs():
    """skyrl 0.4 refuses new keys ("++"); what the engines should get beyond its typed fields goes in
    `generator.sampling_params.additional_kwargs`, which its engines pass on as they are."""
    from skyrl_megatron.hosts import current

    overrides = current().engine_sampling_overrides({"ignore_eos": True, "seed": 7})
    cfg = compose_config(overrides)
    assert cfg.generator.sampling_params.additional_kwargs == {"ignore_eos": True, "seed": 7}


def test_the_demos_vllm_engine_settings_parse_on_this_host():
    """The demo's and the RL step bench's vLLM settings under 0.4's names; 0.4 refuses 0.3.1's synchronous engine
    (`async_engine=false`), so the host adapter leaves its engine mode out."""
    from skyrl_megatron.demo.__main__ import gpu_overrides, merged, vllm_overrides

    cfg = compose_config(merged(gpu_overrides(1), vllm_overrides(1)))
    engine = cfg.generator.inference_engine
    assert (engine.backend, engine.num_engines, engine.tensor_parallel_size) == ("vllm", 1, 1)
    assert engine.enforce_eager is True and engine.gpu_memory_utilization == 0.5
    assert engine.weight_sync_backend == "nccl" and engine.distributed_executor_backend == "mp"
    assert cfg.trainer.placement.colocate_all is True
    # the servers' worker class gets our read-back of its weights (the demo's check after each sync); 0.4 sets
    # each engine_init_kwargs entry on vLLM's arguments, over its own worker extension
    from skyrl_megatron.engines.vllm_extension import WeightReadBack

    qualname = f"{WeightReadBack.__module__}.{WeightReadBack.__qualname__}"
    assert dict(engine.engine_init_kwargs) == {"worker_extension_cls": qualname}


PICK = """
import sys
{setup}
from skyrl_megatron.demo.__main__ import pick_engine
print("auto:", pick_engine("auto", 1))
try:
    pick_engine("vllm", 1)
except SystemExit as exit:
    print("vllm:", exit)
"""


@pytest.mark.slow
def test_the_demo_takes_vllm_on_skyrl_0_4_only_with_its_trainer_side_transfer_api(run_python):
    """skyrl 0.4's servers sync through vLLM 0.30's trainer-side transfer API. The vLLM here (0.24) lacks it: `auto`
    falls back to our HF engine and `--engine vllm` is refused by name; with the bench's bridge giving 0.24 that API
    (as on the GPU machines), vLLM is taken."""
    plain = run_python("-c", PICK.format(setup=""))
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "auto: hf" in plain.stdout and "vllm: skyrl-megatron demo: --engine vllm: vllm 0.24.0" in plain.stdout
    bridged = run_python("-c", PICK.format(setup=f"sys.path.insert(0, {str(BRIDGES)!r}); import sitecustomize"))
    assert bridged.returncode == 0, bridged.stderr[-2000:]
    assert "auto: vllm" in bridged.stdout and "vllm:" not in bridged.stdout, bridged.stdout
