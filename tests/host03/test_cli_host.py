"""The `skyrl-megatron` command on skyrl-train 0.3.1, where skyrl 0.4 does not match it yet.

On skyrl 0.4: `skyrl-megatron --help` is parsed as a config key (0.4's typed parse has no help), and
`compose_config` is the host's full parse, whose post-init imports torch. Both belong back in
tests/test_cli.py once 0.4 has them. The bad-value test is 0.3.1's twin of
tests/host04/test_skyrl04_config_errors.py. The command's other tests run on 0.4: tests/test_cli.py.
"""

from __future__ import annotations

from test_cli import run_cli


def test_help_shows_the_megatron_config(tmp_path):
    out = run_cli(["--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "skyrl-megatron" in out.stdout
    assert "megatron: critic, policy, ref" in out.stdout
    for key in ("tensor_model_parallel_size", "virtual_pipeline_model_parallel_size", "transformer_config_kwargs",
                "optimizer_config_kwargs", "ddp_config", "checkpoint_cache_dir", "lora_config"):
        assert key in out.stdout


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


def test_sampling_settings_without_a_host_key_are_added_to_the_sampling_params():
    """skyrl-train 0.3.1 hands the engines every key of `generator.sampling_params`: new ones are added there."""
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.hosts import current

    cfg = compose_config(current().engine_sampling_overrides({"ignore_eos": True, "seed": 7}))
    assert cfg.generator.sampling_params.ignore_eos is True and cfg.generator.sampling_params.seed == 7


def test_the_demos_vllm_engines_are_the_hosts_synchronous_engine():
    """skyrl-train 0.3.1's engine mode where the demo reads a vLLM engine's weights back (`collective_rpc` on
    the engine actor's `vllm.LLM`)."""
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.demo.__main__ import gpu_overrides, merged, vllm_overrides

    cfg = compose_config(merged(gpu_overrides(1), vllm_overrides(1)))
    generator = cfg.generator
    assert (generator.backend, generator.num_inference_engines, generator.enforce_eager) == ("vllm", 1, True)
    assert generator.async_engine is False and generator.vllm_v1_disable_multiproc is True
