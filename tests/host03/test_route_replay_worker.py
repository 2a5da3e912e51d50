"""Routing replay (R2) in the policy worker, driven by the host's own trainer code (Ray actors, CPU, fp32).

A tiny Qwen3-MoE policy in two actors (EP2, so each DP rank scores and trains its own rows). The
host's `fwd_logprobs_values_reward` calls our `forward`, which records every row's routes; its
`train_critic_and_policy` calls `ppo_train`, which must find them for every row it trains: without
a scoring pass first it refuses by name, and after one the first step's ppo_kl is exactly 0. The
routes of a step do not outlive it. (Bitwise ratio and route checks under every layout, with a
routing flip constructed, are in test_route_replay.py.)

skyrl-train 0.3.1's worker contract (`ppo_train`); skyrl 0.4's: tests/host04/test_skyrl04_route_replay_r2.py.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.host_trainer import trainer_with_workers, training_input

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE = 8, 6, 6
N_SAMPLES, PROMPTS = 2, 4
MC = "trainer.policy.megatron_config"


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_host_config

    cfg = compose_config(
        [
            f"trainer.policy.model.path={hf_dir}",
            f"trainer.ckpt_path={workdir}/ckpt",
            f"trainer.export_path={workdir}/export",
            "trainer.bf16=false",
            "trainer.placement.colocate_all=false",
            "trainer.placement.policy_num_gpus_per_node=2",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2",
            "trainer.algorithm.use_kl_loss=false",  # no reference model
            f"{MC}.expert_model_parallel_size=2",
            f"{MC}.moe_config.routing_replay=r2",
        ]
    )
    validate_host_config(cfg)
    return cfg


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replay_actors")
    hf_dir = str(workdir / "qwen3_moe")
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=11)
    with trainer_with_workers(_config(hf_dir, workdir), hf_dir, num_gpus=2) as trainer:
        yield trainer


def _data(tokenizer):
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5, pad_token_id=tokenizer.pad_token_id)
    return training_input(batch, RESPONSE, global_step=1)


def _train_unscored(trainer, data):
    import ray

    data["action_log_probs"] = torch.zeros(ROWS, RESPONSE)
    refs = trainer.policy_model.async_run_ray_method("mesh", "ppo_train", data)
    with pytest.raises(ray.exceptions.RayTaskError, match="was not scored by this worker's forward.*routing_replay=r2"):
        ray.get(refs, timeout=120)  # a timeout would mean a rank entered a collective alone


def test_training_replays_the_routes_its_scoring_recorded(trainer):
    _train_unscored(trainer, _data(trainer.tokenizer))  # nothing scored yet: refused by name, before any collective
    data = trainer.fwd_logprobs_values_reward(_data(trainer.tokenizer))
    status = trainer.train_critic_and_policy(data)
    assert status["ppo_kl"] == 0.0 and status["ppo_clip_ratio"] == 0.0
    assert status["policy_update_steps"] == 1
    _train_unscored(trainer, _data(trainer.tokenizer))  # the step's routes went with it
