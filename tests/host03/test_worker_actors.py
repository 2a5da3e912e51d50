"""Policy and reference workers as Ray actors, built and driven by the host's own trainer code (CPU).

The host's `RayPPOTrainer.build_models` creates the groups: the policy's two actors in a placement
group, one ref actor, each group's mesh ranks read once for `MeshDispatch`. Its own
`fwd_logprobs_values_reward` and `train_critic_and_policy` then score and train through them, as
between two generation steps of a real run. fp32 throughout, so numbers compare tightly.

What CPU needs, and nothing more: Ray is told of logical GPUs (our actors ask for one each, the
host's placement groups bundle GPUs) and every Ray process runs our CPU runtime; the trainer is
built without dataset, inference engines or generator (its dataloader hook is overridden, see
`skyrl_megatron.testing.host_trainer`); the host's HF reference runs with flash-attn's Triton
cross entropy off.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.host_trainer import (
    build_worker_groups,
    host_trainer,
    start_ray_for_cpu_workers,
    training_input,
)

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE = 8, 6, 6
LR = 1e-3
KL_LOSS_COEF = 0.1
LOGPROB_ATOL = 1e-4
# ROWS sequences = train_batch_size prompts x n_samples_per_prompt; one mini-batch holds them all,
# so every ppo_train is exactly one optimizer step (the "first step" of a training batch)
N_SAMPLES, PROMPTS = 2, 4
HOST_METRICS = (
    "policy_loss",
    "ppo_clip_ratio",
    "policy_entropy",
    "raw_grad_norm",
    "policy_lr",
    "final_loss",
    "policy_update_steps",
)


@dataclass
class Actors:
    trainer: Any  # the host's RayPPOTrainer, holding policy_model / ref_model actor groups
    tokenizer: Any
    batch: dict[str, torch.Tensor]
    host_logprobs: torch.Tensor  # the host's HFModelWrapper on the same batch
    initial_policy: torch.Tensor  # mesh-dispatched forwards right after build_models
    initial_ref: torch.Tensor

    @property
    def policy(self):
        return self.trainer.policy_model

    @property
    def ref(self):
        return self.trainer.ref_model

    @property
    def response_mask(self) -> torch.Tensor:
        return self.batch["loss_mask"].bool()

    def data(self, rows: int | None = None):
        batch = {k: v[:rows] for k, v in self.batch.items()}
        return training_input(batch, RESPONSE, global_step=1)


def _host_hf_logprobs(hf_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from skyrl_megatron.activation import activate

    activate()
    import skyrl_train.utils.torch_utils as torch_utils
    from skyrl_train.model_wrapper import HFModelWrapper

    # flash-attn's Triton cross entropy imports without a GPU but cannot run on CPU
    torch_utils.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
    model = HFModelWrapper(hf_dir, bf16=False).eval()
    with torch.no_grad():
        return model(batch["sequences"], RESPONSE, batch["attention_mask"]).float()


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_host_config

    cache = workdir / "conversion_cache"
    cfg = compose_config(
        [
            f"trainer.policy.model.path={hf_dir}",
            f"trainer.ckpt_path={workdir}/ckpt",
            f"trainer.export_path={workdir}/export",
            "trainer.bf16=false",
            # no inference engines here: policy and ref get their own actors
            "trainer.placement.colocate_all=false",
            "trainer.placement.colocate_policy_ref=false",
            "trainer.placement.policy_num_gpus_per_node=2",
            "trainer.placement.ref_num_gpus_per_node=1",
            f"generator.n_samples_per_prompt={N_SAMPLES}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2",
            "trainer.algorithm.use_kl_loss=true",  # makes the host build the ref group
            f"trainer.algorithm.kl_loss_coef={KL_LOSS_COEF}",
            f"trainer.policy.optimizer_config.lr={LR}",
            f"trainer.policy.megatron_config.checkpoint_cache_dir={cache}",
            f"trainer.ref.megatron_config.checkpoint_cache_dir={cache}",
            # TP2 policy: the host must send both actors the same rows and collect from TP rank 0 only
            "trainer.policy.megatron_config.tensor_model_parallel_size=2",
        ]
    )
    validate_host_config(cfg)  # the host's own checks; also derives trainer.algorithm.max_seq_len
    return cfg


def _forward(group, data) -> torch.Tensor:
    """What the trainer does: only the forward inputs, mesh-dispatched, collected in DP order."""
    inputs = data.select(keys=["sequences", "attention_mask"], metadata_keys=["response_length"])
    return group.run_method("mesh", "forward", inputs)["output"]


def _train_step(actors: Actors) -> tuple[dict[str, float], Any]:
    """One host training step: ref + policy scoring, then ppo_train, through the host trainer."""
    data = actors.trainer.fwd_logprobs_values_reward(actors.data())
    return actors.trainer.train_critic_and_policy(data), data


def _save(actors: Actors, ckpt_dir: str) -> None:
    """The trainer's save_checkpoints call for the policy group."""
    import ray

    refs = actors.policy.async_run_ray_method(
        "pass_through", "save_checkpoint", ckpt_dir=ckpt_dir, tokenizer=actors.tokenizer
    )
    ray.get(refs)


def _load(actors: Actors, ckpt_dir: str) -> None:
    """The trainer's load_checkpoints call for the policy group."""
    import ray

    refs = actors.policy.async_run_ray_method(
        "pass_through",
        "load_checkpoint",
        ckpt_dir=ckpt_dir,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    ray.get(refs)


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    workdir = tmp_path_factory.mktemp("actors")
    hf_dir = str(workdir / "qwen3")
    make_tiny_hf_model("qwen3", hf_dir, seed=11)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5, pad_token_id=tokenizer.pad_token_id)
    host_logprobs = _host_hf_logprobs(hf_dir, batch)

    cfg = _config(hf_dir, workdir)
    start_ray_for_cpu_workers(num_gpus=3, num_cpus=3)
    try:
        trainer = host_trainer(cfg, tokenizer, total_training_steps=100)
        build_worker_groups(trainer)
        data = training_input(batch, RESPONSE)
        yield Actors(
            trainer=trainer,
            tokenizer=tokenizer,
            batch=batch,
            host_logprobs=host_logprobs,
            initial_policy=_forward(trainer.policy_model, data),
            initial_ref=_forward(trainer.ref_model, data),
        )
    finally:
        ray.shutdown()


def test_groups_have_megatron_mesh_ranks(actors):
    """The host planned dispatch from our workers' Megatron coordinates, not its own DP-only mesh."""
    ranks = [info.rank for info in actors.policy.actor_infos]
    # the host's own set-up would report dp=rank, dp_size=2 and split the batch between TP ranks
    assert [(r.dp, r.sp, r.tp, r.pp, r.dp_size) for r in ranks] == [(0, 0, 0, 0, 1), (0, 0, 1, 0, 1)]
    assert [r.is_collection_dp_rank() for r in ranks] == [True, False]
    (ref_rank,) = [info.rank for info in actors.ref.actor_infos]
    assert (ref_rank.dp_size, ref_rank.world_size) == (1, 1)


def test_forward_matches_the_hosts_hf_logprobs(actors):
    mask = actors.response_mask
    for name, logprobs in (("policy", actors.initial_policy), ("ref", actors.initial_ref)):
        assert logprobs.shape == (ROWS, RESPONSE)
        diff = (logprobs - actors.host_logprobs).abs()[mask].max().item()
        assert diff <= LOGPROB_ATOL, f"{name} group: logprobs differ from the host's HF wrapper by {diff:.2e}"


def test_ppo_train_reports_the_hosts_metrics(actors):
    before = _forward(actors.policy, actors.data())
    status, data = _train_step(actors)

    # the host trainer filled the batch from our groups: the ref never trains
    assert torch.equal(data["base_action_log_probs"], actors.initial_ref)
    assert torch.equal(data["action_log_probs"], before)
    missing = [name for name in HOST_METRICS if name not in status]
    assert not missing, f"train_status lacks {missing}: {sorted(status)}"
    assert all(f"policy/{name}" in actors.trainer.all_metrics for name in HOST_METRICS)

    # old logprobs come from the same weights: ratio exactly 1, so nothing clips and the regular
    # PPO loss is minus the token-mean advantage
    assert status["ppo_kl"] == 0.0
    assert status["ppo_clip_ratio"] == 0.0
    mask = data["loss_mask"].float()
    token_mean_advantage = float((data["advantages"] * mask).sum() / mask.sum())
    assert status["policy_loss"] == pytest.approx(-token_mean_advantage, rel=1e-5, abs=1e-7)
    assert status["final_loss"] == pytest.approx(
        status["policy_loss"] + KL_LOSS_COEF * status["policy_kl"], rel=1e-5, abs=1e-7
    )
    assert 0.0 < status["policy_entropy"] <= math.log(256) + 1e-4
    assert math.isfinite(status["raw_grad_norm"]) and status["raw_grad_norm"] > 0
    assert status["policy_lr"] == pytest.approx(LR)
    assert status["policy_update_steps"] == 1

    after = _forward(actors.policy, actors.data())
    assert (after - before).abs()[actors.response_mask].max() > 1e-5, "the optimizer step did not move the policy"


def test_offload_and_backload_keep_forward_and_training_identical(actors, tmp_path):
    ckpt_dir = str(tmp_path / "policy")
    _save(actors, ckpt_dir)
    reference_status, _ = _train_step(actors)
    reference_after = _forward(actors.policy, actors.data())
    _load(actors, ckpt_dir)
    policy_before = _forward(actors.policy, actors.data())
    ref_before = _forward(actors.ref, actors.data())

    import ray

    ray.get(actors.policy.async_run_ray_method("pass_through", "transfer_summary"))  # start from an empty log
    offloaded = actors.policy.offload_to_cpu() + actors.ref.offload_to_cpu()
    assert [report["parts"] for report in offloaded] == [["model", "optimizer"]] * 2 + [["model"]]
    assert all(report["gib_moved"] > 0 for report in offloaded)
    backloaded = actors.policy.backload_to_gpu() + actors.ref.backload_to_gpu()
    assert [r["gib_moved"] for r in backloaded] == [r["gib_moved"] for r in offloaded]
    # each worker's transfer log holds exactly these two calls (the demo's per-step offload report)
    # and is empty once read
    summaries = ray.get(actors.policy.async_run_ray_method("pass_through", "transfer_summary"))
    for rank, summary in enumerate(summaries):
        assert summary["transfers"] == 2
        assert summary["offload_gib"] == pytest.approx(offloaded[rank]["gib_moved"])
        assert summary["backload_gib"] == pytest.approx(backloaded[rank]["gib_moved"])
        assert summary["offload_s"] > 0 and summary["backload_s"] > 0
    assert ray.get(actors.policy.async_run_ray_method("pass_through", "transfer_summary"))[0]["transfers"] == 0

    assert torch.equal(_forward(actors.policy, actors.data()), policy_before)
    assert torch.equal(_forward(actors.ref, actors.data()), ref_before)
    # the optimizer state (Adam moments, step count) came back too: the same step as without the
    # round trip
    status, _ = _train_step(actors)
    assert status["raw_grad_norm"] == reference_status["raw_grad_norm"]
    assert torch.equal(_forward(actors.policy, actors.data()), reference_after)


def test_checkpoint_round_trip_restores_weights_and_optimizer(actors, tmp_path):
    ckpt_dir = str(tmp_path / "global_step_1" / "policy")
    _save(actors, ckpt_dir)
    saved = _forward(actors.policy, actors.data())

    first_status, _ = _train_step(actors)
    first_after = _forward(actors.policy, actors.data())
    assert not torch.equal(first_after, saved)

    _load(actors, ckpt_dir)
    assert torch.equal(_forward(actors.policy, actors.data()), saved)
    # the same step from the restored state (weights, Adam moments, LR schedule) lands on the same weights
    second_status, _ = _train_step(actors)
    for name in ("final_loss", "policy_loss", "raw_grad_norm", "policy_lr"):
        assert second_status[name] == first_status[name], name
    assert torch.equal(_forward(actors.policy, actors.data()), first_after)


def test_bad_batch_size_fails_fast_with_a_clear_error(actors):
    import ray

    data = actors.data(rows=ROWS - 2)  # the rank's 6 rows are not a whole number of 8-row mini-batches
    data["action_log_probs"] = torch.zeros(ROWS - 2, RESPONSE)
    data["base_action_log_probs"] = torch.zeros(ROWS - 2, RESPONSE)
    refs = actors.policy.async_run_ray_method("mesh", "ppo_train", data)
    with pytest.raises(ray.exceptions.RayTaskError, match="not a multiple of the per-rank mini-batch"):
        ray.get(refs, timeout=120)  # a timeout here would mean a rank entered a collective alone
    # both ranks refused before touching the model: the group still trains
    status, _ = _train_step(actors)
    assert status["policy_update_steps"] == 1


def test_out_of_memory_in_a_training_step_names_the_worker_and_the_knobs(actors):
    """A real allocator failure in ppo_train (rows of 2^17 prompt tokens: the CPU attention's packed
    causal mask alone would be tens of GiB) reaches the driver as one error per the knobs, no hang;
    the workers go on afterwards."""
    from skyrl_megatron.workers.out_of_memory import WorkerOutOfMemory

    data = actors.trainer.fwd_logprobs_values_reward(actors.data())
    extra = 2**17
    rows = data["sequences"].shape[0]
    long_data = data.select(keys=list(data.keys()), metadata_keys=list(data.metadata))
    long_data["sequences"] = torch.cat([torch.full((rows, extra), 5, dtype=data["sequences"].dtype),
                                        data["sequences"]], dim=1)
    mask = torch.cat([torch.ones(rows, extra, dtype=data["attention_mask"].dtype), data["attention_mask"]], dim=1)
    mask[:, : mask.shape[1] - RESPONSE] = 1  # one contiguous run: the old left padding becomes prompt
    long_data["attention_mask"] = mask
    with pytest.raises(Exception) as raised:
        actors.trainer.train_critic_and_policy(long_data)
    message = str(raised.value)
    assert WorkerOutOfMemory.__name__ in message or isinstance(raised.value, WorkerOutOfMemory), message
    # both TP ranks run out of memory; whichever reports first reaches the driver, with its own coordinates
    assert re.search(r"policy worker rank (\d)/2 \(dp 0, cp 0, tp \1, pp 0\) ran out of memory while training", message), message
    assert "trainer.policy.megatron_config.max_tokens_per_microbatch" in message
    assert "recompute_granularity=full" in message
    # the failed step left the workers usable
    assert torch.isfinite(_forward(actors.policy, actors.data())).all()
