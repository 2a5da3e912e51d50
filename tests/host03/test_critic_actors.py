"""The critic worker as Ray actors, built and driven by the host's own trainer code (CPU, fp32).

The host's `RayPPOTrainer.build_models` creates a critic group of two actors (TP=2 + SP) beside a
one-rank policy; its `fwd_logprobs_values_reward` fills the batch's values from our critic, and
its mesh dispatch sends `ppo_train` to the group. Checked: values equal the HF critic's, the host's
critic metrics come back, repeated steps on one batch lower the value loss, and an offload/backload
round trip keeps the values and the optimizer state.

skyrl-train 0.3.1's worker contract (`ppo_train`); skyrl 0.4's: tests/host04/test_skyrl04_critic.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.critic_steps import synthetic_returns
from skyrl_megatron.testing.host_trainer import (
    build_worker_groups,
    host_trainer,
    start_ray_for_cpu_workers,
    training_input,
)

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE = 8, 6, 6
N_SAMPLES, PROMPTS = 2, 4
SEED = 7
VALUE_ATOL = 1e-5
# the host's CriticWorkerBase.ppo_train reports these (with critic_update_steps)
HOST_METRICS = ("critic_loss", "values_mean", "values_clipfrac", "raw_grad_norm", "critic_lr", "critic_update_steps")


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config

    cfg = compose_config(
        [
            f"trainer.policy.model.path={hf_dir}",
            f"trainer.critic.model.path={hf_dir}",
            "trainer.algorithm.advantage_estimator=gae",
            f"trainer.ckpt_path={workdir}/ckpt",
            f"trainer.export_path={workdir}/export",
            f"trainer.seed={SEED}",
            "trainer.bf16=false",
            "trainer.placement.colocate_all=false",
            "trainer.algorithm.use_kl_loss=false",  # no reference group: policy (1 rank) and critic (2)
            "trainer.placement.policy_num_gpus_per_node=1",
            "trainer.placement.critic_num_gpus_per_node=2",
            "trainer.policy.megatron_config.runtime=cpu",
            "trainer.critic.megatron_config.runtime=cpu",
            "trainer.critic.megatron_config.tensor_model_parallel_size=2",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            f"trainer.critic_mini_batch_size={PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2",
            "trainer.critic.optimizer_config.lr=1e-3",
        ]
    )
    validate_config(cfg)  # ours and the host's (its Megatron critic ban lifted)
    return cfg


def _hf_values(hf_dir: str, batch) -> torch.Tensor:
    """The host's critic forward on the HF trunk with the head our worker draws (see test_critic)."""
    from transformers import AutoModel

    from skyrl_megatron.model.adapters.value_head import ValueHeadInit

    head = ValueHeadInit.for_checkpoint(hf_dir, policy_path=hf_dir, seed=SEED).make_weight(torch.float32)
    trunk = AutoModel.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    mask = batch["attention_mask"]
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        hidden = trunk(batch["sequences"], attention_mask=mask, position_ids=position_ids).last_hidden_state
    return (hidden @ head.t()).squeeze(-1)[:, :-1][:, -RESPONSE:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    workdir = tmp_path_factory.mktemp("critic_actors")
    hf_dir = str(workdir / "qwen3")
    make_tiny_hf_model("qwen3", hf_dir, seed=11)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5, pad_token_id=tokenizer.pad_token_id)
    cfg = _config(hf_dir, workdir)
    start_ray_for_cpu_workers(num_gpus=3, num_cpus=3)
    try:
        trainer = host_trainer(cfg, tokenizer, total_training_steps=100)
        build_worker_groups(trainer)
        yield {"trainer": trainer, "batch": batch, "hf_values": _hf_values(hf_dir, batch)}
    finally:
        ray.shutdown()


def _values(trainer, batch) -> torch.Tensor:
    """The trainer's scoring phase; returns the values it put into the batch."""
    return trainer.fwd_logprobs_values_reward(training_input(batch, RESPONSE, global_step=1))["values"]


def _critic_step(trainer, batch, old_values: torch.Tensor) -> dict:
    import ray

    data = training_input(batch, RESPONSE, global_step=1)
    data["values"] = old_values
    data["returns"] = synthetic_returns(batch["loss_mask"], seed=5)
    statuses = ray.get(trainer.critic_model.async_run_ray_method("mesh", "ppo_train", data))
    return statuses[0].metadata["train_status"]


def test_the_critic_group_has_megatron_mesh_ranks(run):
    ranks = [info.rank for info in run["trainer"].critic_model.actor_infos]
    assert [(r.dp, r.tp, r.dp_size) for r in ranks] == [(0, 0, 1), (0, 1, 1)]


def test_values_match_the_hf_critic_and_training_on_one_batch_lowers_the_value_loss(run):
    trainer, batch = run["trainer"], run["batch"]
    mask = batch["loss_mask"].bool()
    values = _values(trainer, batch)
    assert values.shape == (ROWS, RESPONSE)
    assert (values - run["hf_values"]).abs()[mask].max().item() <= VALUE_ATOL
    assert values[~mask].abs().max().item() == 0.0

    # PPO's loop on one batch: score (old values = the current critic's), then train on it
    statuses = [_critic_step(trainer, batch, values)]
    for _ in range(2):
        statuses.append(_critic_step(trainer, batch, _values(trainer, batch)))
    for status in statuses:
        missing = [name for name in HOST_METRICS if name not in status]
        assert not missing, f"train_status lacks {missing}: {sorted(status)}"
        assert status["critic_update_steps"] == 1 and math.isfinite(status["raw_grad_norm"])
    losses = [s["critic_loss"] for s in statuses]
    assert losses[0] > losses[1] > losses[2], losses
    after = _values(trainer, batch)
    returns = synthetic_returns(batch["loss_mask"], seed=5)
    assert (after - returns).abs()[mask].mean() < (values - returns).abs()[mask].mean()


def test_offload_and_backload_keep_the_values_and_training_goes_on(run):
    trainer, batch = run["trainer"], run["batch"]
    critic = trainer.critic_model
    before = _values(trainer, batch)
    offloaded = critic.offload_to_cpu()
    assert [r["parts"] for r in offloaded] == [["model", "optimizer"]] * 2
    assert all(r["gib_moved"] > 0 for r in offloaded)
    backloaded = critic.backload_to_gpu()
    assert [r["gib_moved"] for r in backloaded] == [r["gib_moved"] for r in offloaded]
    assert torch.equal(_values(trainer, batch), before)
    # the optimizer state came back: the next step trains at the configured LR
    status = _critic_step(trainer, batch, before)
    assert math.isfinite(status["critic_loss"]) and status["critic_lr"] == pytest.approx(1e-3)


def test_an_offloaded_critic_exports_the_weights_it_holds(run, tmp_path):
    """A colocated run's last HF save finds the critic offloaded (the host backloads only the policy):
    the export brings the weights back for itself, writes what a resident export writes, and parks
    them again."""
    import ray
    from safetensors.torch import load_file

    critic = run["trainer"].critic_model

    def export(name: str) -> dict[str, torch.Tensor]:
        ray.get(critic.async_run_ray_method("pass_through", "save_hf_model", str(tmp_path / name)))
        return {k: v for path in sorted((tmp_path / name).glob("*.safetensors")) for k, v in load_file(path).items()}

    resident = export("resident")
    critic.offload_to_cpu()
    try:
        offloaded = export("offloaded")
        # parked again: a second offload finds nothing of the model left to move
        assert all("model" not in report["parts"] for report in critic.offload_to_cpu())
    finally:
        critic.backload_to_gpu()
    assert resident.keys() == offloaded.keys() and len(resident) > 0
    assert all(torch.equal(resident[name], offloaded[name]) for name in resident)
