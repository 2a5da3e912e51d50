"""The demo's parts that run without Ray: its task, its data, its config (the run itself is in test_e2e_grpo)."""

from __future__ import annotations

import json
import re

import pytest

from skyrl_megatron.demo.task import ENV_ID, digit_share, register_environment


@pytest.mark.parametrize(
    "reply, reward", [("123", 1.0), ("a1b2", 0.5), ("", 0.0), ("no digits", 0.0), ("7 ", 0.5)]
)
def test_reward_is_the_digit_share_of_the_reply(reply, reward):
    assert digit_share(reply) == reward


def test_environment_is_made_by_name_through_skyrl_gym_and_scores_one_turn():
    import skyrl_gym

    register_environment()
    register_environment()  # idempotent
    env = skyrl_gym.make(ENV_ID, env_config={}, extras={})
    out = env.step("12ab")
    assert out["reward"] == 0.5 and out["done"] is True


def test_demo_config_composes_and_passes_every_check(tmp_path):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config
    from skyrl_megatron.demo.__main__ import demo_overrides, prepare, run_overrides

    model_dir, prompts = prepare(tmp_path, steps=2)
    cfg = compose_config(demo_overrides(tmp_path, model_dir, prompts, steps=2, ckpt_interval=1))
    validate_config(cfg)  # ours and the host's
    assert cfg.generator.engine == "cpu" and cfg.trainer.strategy == "megatron"
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 2
    # everything the demo hands the host: on skyrl 0.4 the prompts load in the trainer's process (its loader would
    # spawn worker processes each epoch for a prompt file of tens of prompts)
    handed = compose_config(run_overrides(tmp_path, model_dir, prompts, 2, 1))
    validate_config(handed)
    assert handed.data.dataloader.num_workers == 0


def test_cpu_engine_settings_that_cannot_work_are_named_with_their_fix(tmp_path):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.hosts import current
    from skyrl_megatron.validation import validate_config
    from skyrl_megatron.demo.__main__ import demo_overrides, prepare, run_overrides

    model_dir, prompts = prepare(tmp_path, steps=2)
    overrides = demo_overrides(tmp_path, model_dir, prompts, steps=2, ckpt_interval=1)
    # our errors name the key as the installed host spells it (skyrl 0.4: generator.inference_engine.*)
    sync = current().host_key_names().get("generator.weight_sync_backend", "generator.weight_sync_backend")
    bad = overrides + ["generator.weight_sync_backend=nccl", "trainer.placement.colocate_all=true"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(bad), run_host_checks=False)
    message = str(err.value)
    assert f"{sync}: " in message and f"set {sync}=gloo" in message
    assert "set trainer.placement.colocate_all=False" in message
    with pytest.raises(ConfigError, match="generator.engine.*unknown engine 'tpu'"):
        validate_config(compose_config(overrides + ["generator.engine=tpu"]), run_host_checks=False)
    # the HF engine on a GPU of its own takes NCCL broadcast (the CPU demo's gloo is named with its fix)
    with pytest.raises(ConfigError, match=rf"is 'gloo' but generator.engine=gpu needs 'nccl'.*Fix: set {re.escape(sync)}=nccl"):
        validate_config(compose_config(overrides + ["generator.engine=gpu"]), run_host_checks=False)


def test_ppo_demo_config_composes_and_passes_every_check(tmp_path):
    """`--ppo`: GAE with a Megatron critic from the policy's checkpoint, accepted by ours and the host's checks."""
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.config import active_roles
    from skyrl_megatron.hosts import current
    from skyrl_megatron.validation import validate_config
    from skyrl_megatron.demo.__main__ import demo_overrides, ppo_overrides, prepare

    model_dir, prompts = prepare(tmp_path, steps=2)
    overrides = demo_overrides(tmp_path, model_dir, prompts, steps=2, ckpt_interval=1) + ppo_overrides(model_dir)
    cfg = compose_config(overrides)
    validate_config(cfg)
    assert cfg.trainer.algorithm.advantage_estimator == "gae"
    assert cfg.trainer.critic.model.path == cfg.trainer.policy.model.path
    assert active_roles(current().our_view(cfg)) == ["policy", "ref", "critic"]  # ours reads our view


def test_the_reward_plot_title_fits_the_figure(tmp_path):
    import json

    from skyrl_megatron.demo.experiment import REWARD, reward_figure

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, REWARD: s / 10}) + "\n" for s in range(1, 11)))
    fig = reward_figure(metrics, "Megatron workers, HF engine on 1 GPU (colocated)")  # the longest subtitle
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig.axes[0].title.get_window_extent(renderer)
    width, height = fig.bbox.width, fig.bbox.height
    assert 0 <= title.x0 and title.x1 <= width and title.y1 <= height, (title, width, height)


def test_a_users_override_replaces_the_demos_value_of_that_key(tmp_path):
    """`python -m skyrl_megatron.demo trainer.ckpt_interval=-1`: one value per key reaches the host (Hydra
    refuses a key given twice), the user's."""
    from skyrl_megatron.demo.__main__ import demo_overrides, merged, prepare

    model_dir, prompts = prepare(tmp_path, steps=2)
    overrides = merged(demo_overrides(tmp_path, model_dir, prompts, steps=2, ckpt_interval=1),
                       ["trainer.ckpt_interval=-1", "trainer.policy.megatron_config.max_tokens_per_microbatch=512"])
    assert [o for o in overrides if o.startswith("trainer.ckpt_interval=")] == ["trainer.ckpt_interval=-1"]
    assert "trainer.policy.megatron_config.max_tokens_per_microbatch=512" in overrides


def test_the_demo_trains_a_given_checkpoint_and_refuses_a_directory_without_one(tmp_path):
    from skyrl_megatron.demo.__main__ import prepare
    from skyrl_megatron.testing import make_tiny_hf_model

    given = tmp_path / "given"
    make_tiny_hf_model("qwen3", given, seed=1)
    model_dir, _ = prepare(tmp_path / "run", steps=1, model=given)
    assert model_dir == given and not (tmp_path / "run" / "model").exists()
    with pytest.raises(SystemExit, match="no config.json"):
        prepare(tmp_path / "run2", steps=1, model=tmp_path / "empty")


def test_the_demo_names_a_bad_value_and_its_fix_before_torch_loads(run_python, demo_run_dir):
    out = run_python("-m", "skyrl_megatron.demo", "--out", str(demo_run_dir),
                     "trainer.policy.megatron_config.fused_kernels=[rope,swigl]")
    assert out.returncode == 2, out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("skyrl-megatron:")] == [
        "skyrl-megatron: invalid skyrl-megatron config: trainer.policy.megatron_config.fused_kernels: unknown kernel "
        "'swigl'. Fix: did you mean 'swiglu'? (known: rms_norm, rope, qk_norm_rope, swiglu, swiglu_gemm, swiglu_gemm_training, swiglu_gemm_experts, logprobs, lse_gemm)."]
    assert not out.loaded("torch")


def test_a_first_run_names_a_bad_value_before_it_creates_its_model(run_python, tmp_path):
    """On a fresh run directory the demo would import torch to write its model: the config is checked
    first, the message is the same, and nothing is created."""
    run_dir = tmp_path / "fresh"
    out = run_python("-m", "skyrl_megatron.demo", "--out", str(run_dir),
                     "trainer.policy.megatron_config.tensor_model_parallel_size=3")
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("skyrl-megatron:")]
    assert "tensor/pipeline/context_parallel_size: policy world size 2" in line and "Fix: " in line
    assert not out.loaded("torch")
    assert not (run_dir / "model").exists()
