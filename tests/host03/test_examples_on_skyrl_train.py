"""The example launch scripts on skyrl-train 0.3.1: the checks of tests/test_examples.py (which runs them on
skyrl 0.4) under this host, and the scripts' layouts scaled to 2 GPUs as bench/gpu_examples.py runs them (on
skyrl-train 0.3.1, whose CUDA IPC path lets our HF engine share the trainers' GPUs)."""

from __future__ import annotations

import json

import pytest
from test_examples import (  # noqa: F401  (collected here again, under this host)
    EXAMPLES,
    PLANNED,
    compose_config,
    our_view,
    test_every_example_is_covered,
    test_extra_arguments_reach_the_command_last,
    test_fsdp_baseline_trains_the_same_run_with_the_hosts_fsdp2,
    test_overrides_compose_and_pass_validation,
    test_pasted_memory_plan_is_current_matches_the_layout_and_fits,
)

from skyrl_megatron.demo.__main__ import prepare, run_overrides
from skyrl_megatron.planner.cli import estimate_from_argv
from skyrl_megatron.validation import validate_config

from example_layouts import launch_overrides, model_config_of, scale_example  # noqa: E402  (on the path through test_examples)
from gpu_examples import demo_arguments  # noqa: E402


@pytest.mark.parametrize("script", PLANNED, ids=lambda s: s.name)
def test_each_example_scaled_to_two_gpus_keeps_its_settings_and_validates(script, tmp_path):
    """bench/gpu_examples.py's runs: the script's Megatron settings at sizes of 2 GPUs (none above 2), its
    model's widths with fewer layers, composed with the demo's 2-GPU settings: our checks and the host's pass."""
    example = scale_example(script, tmp_path / "launch", gpus=2)
    published = json.loads(model_config_of(script).read_text())
    assert example.layers < published["num_hidden_layers"] or example.model == "Qwen3-1.7B"
    assert {k: v for k, v in example.model_config.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in published.items() if k != "num_hidden_layers"}
    script_overrides = launch_overrides(script, tmp_path / "again")
    for override in script_overrides:
        key, value = override.split("=", 1)
        if ".megatron_config." in key and not key.endswith("_parallel_size"):
            assert override in example.overrides, f"{override} lost in scaling"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(example.model_config))
    args = demo_arguments(example, model_dir, tmp_path / "run")
    extra = args[args.index("0") + 1:]  # after --ckpt-interval 0: the overrides
    _, prompts = prepare(tmp_path / "run", steps=2, model=model_dir)
    host_cfg = compose_config(run_overrides(tmp_path / "run", model_dir, prompts, 2, 0, gpus=2, extra=extra))
    validate_config(host_cfg)
    cfg = our_view(host_cfg)
    for role in ("policy", "ref"):
        mc = cfg.trainer[role].megatron_config
        sizes = [mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size]
        assert sizes[0] * sizes[1] * sizes[2] <= 2 and mc.expert_model_parallel_size <= 2
    mc = cfg.trainer.policy.megatron_config
    assert str(mc.max_tokens_per_microbatch) == example.setting("max_tokens_per_microbatch")
    assert (mc.transformer_config_kwargs.get("recompute_granularity") or "null") == \
        (example.setting("transformer_config_kwargs.recompute_granularity") or "null")
    assert cfg.trainer.algorithm.use_kl_loss == our_view(compose_config(script_overrides)).trainer.algorithm.use_kl_loss
    assert cfg.trainer.ckpt_interval == 0 and cfg.generator.num_inference_engines == 2
    # the plan printed beside the run: the planner takes the scaled layout's arguments (`null` recompute is its `none`)
    planned = estimate_from_argv(["--model", str(model_dir / "config.json"), *example.planner_args])
    assert planned.total > 0
    recompute = mc.transformer_config_kwargs.get("recompute_granularity")
    assert example.planner_args.count("--recompute") == (1 if recompute else 0)
