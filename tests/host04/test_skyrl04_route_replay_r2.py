"""R2 routing replay through skyrl 0.4's trainer, with a step of two mini-batches (CPU, fp32, Ray).

skyrl 0.4 scores a step mini-batch by mini-batch (`recompute_old_logprobs_per_minibatch`, on by
default) before it trains any: the policy must keep the routes of every scoring call until the step
trains, not only the last call's. With lr 0 every mini-batch trains on the scored weights, so each
one's ratio is exactly 1 (ppo_kl 0). The next step's scoring starts afresh.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.host_trainer import trainer_with_workers, training_input

pytestmark = pytest.mark.slow

PROMPTS, N_SAMPLES, PROMPT, RESPONSE = 4, 2, 6, 6
ROWS = PROMPTS * N_SAMPLES
MC = "trainer.policy.megatron_config"


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config

    cfg = compose_config([
        f"trainer.policy.model.path={hf_dir}",
        f"trainer.ckpt_path={workdir}/ckpt",
        f"trainer.export_path={workdir}/export",
        "trainer.bf16=false",
        "trainer.placement.colocate_all=false",
        "trainer.placement.policy_num_gpus_per_node=1",
        f"generator.n_samples_per_prompt={N_SAMPLES}",
        f"trainer.train_batch_size={PROMPTS}",
        f"trainer.policy_mini_batch_size={PROMPTS // 2}",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.algorithm.use_kl_loss=false",
        f"trainer.algorithm.max_seq_len={PROMPT + RESPONSE}",
        "trainer.policy.optimizer_config.lr=0.0",
        "trainer.policy.optimizer_config.num_warmup_steps=0",
        f"{MC}.runtime=cpu",
        f"{MC}.checkpoint_cache_dir={workdir}/conversion_cache",
        f"{MC}.moe_config.routing_replay=r2",
        "trainer.remove_microbatch_padding=false",
    ])
    validate_config(cfg)
    return cfg


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("host04_r2")
    hf_dir = str(workdir / "qwen3_moe")
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=11)
    with trainer_with_workers(_config(hf_dir, workdir), hf_dir, num_gpus=1) as trainer:
        yield trainer


def _step(trainer, seed: int) -> dict:
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=seed, pad_token_id=trainer.tokenizer.pad_token_id)
    batch["response_mask"] = (batch["loss_mask"] > 0).long()
    data = training_input(batch, RESPONSE, global_step=1, uids=[str(i // N_SAMPLES) for i in range(ROWS)],
                          policy_mini_batch_boundaries=[(0, ROWS // 2), (ROWS // 2, ROWS)])
    data = trainer.fwd_logprobs_values_reward(data)
    return trainer.train_critic_and_policy(data)


def test_every_mini_batch_replays_its_scoring_routes_step_after_step(trainer):
    assert trainer.cfg.trainer.recompute_old_logprobs_per_minibatch  # the host's default: scored per mini-batch
    for seed in (5, 6):  # a second step: its own rows, scored afresh
        status = _step(trainer, seed)
        assert status["ppo_kl"] == 0.0 and status["ppo_clip_ratio"] == 0.0, status
