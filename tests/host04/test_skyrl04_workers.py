"""Our policy and reference workers as Ray actors, driven by skyrl 0.4's own trainer (CPU, fp32).

skyrl 0.4's `RayPPOTrainer.build_models` creates the groups (a TP2 policy of two actors, one ref
actor) through its `WorkerDispatch`; its `fwd_logprobs_values_reward` scores through `forward`, and
`train_critic_and_policy` normalises the advantages over each mini-batch, stages the per-DP chunks
and calls `forward_backward` + `optim_step` on our workers: 0.4's worker contract, end to end.
The trainer is built without dataset, inference engines or generator
(`skyrl_megatron.testing.host_trainer`), as on the 0.3.1 leg (`tests/host03/test_worker_actors.py`).
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.host_trainer import build_worker_groups, host_trainer, start_ray_for_cpu_workers, training_input

pytestmark = pytest.mark.slow

ROWS, PROMPT, RESPONSE = 8, 6, 6
N_SAMPLES, PROMPTS = 2, 4
LR = 1e-3
KL_LOSS_COEF = 0.1
LOGPROB_ATOL = 1e-4


def _host_hf_logprobs(hf_dir: str, batch) -> torch.Tensor:
    """skyrl 0.4's own HF model wrapper on the same batch (fp32, eager attention)."""
    from skyrl_megatron.activation import activate

    activate()  # the host imports flash_attn's padding helpers (flash-attn without its CUDA build here)
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    model = HFModelWrapper(hf_dir, bf16=False).eval()
    with torch.no_grad():
        return model(batch["sequences"], RESPONSE, batch["attention_mask"]).float()


def _config(hf_dir: str, workdir, mini_batch_prompts: int):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config

    cache = workdir / "conversion_cache"
    cfg = compose_config([
        "trainer.strategy=megatron",
        f"trainer.policy.model.path={hf_dir}",
        f"trainer.ckpt_path={workdir}/ckpt",
        f"trainer.export_path={workdir}/export",
        "trainer.logger=console",
        "trainer.bf16=false",
        "trainer.placement.colocate_all=false",
        "trainer.placement.colocate_policy_ref=false",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.placement.ref_num_gpus_per_node=1",
        f"generator.n_samples_per_prompt={N_SAMPLES}",
        f"trainer.train_batch_size={PROMPTS}",
        f"trainer.policy_mini_batch_size={mini_batch_prompts}",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.algorithm.use_kl_loss=true",
        f"trainer.algorithm.kl_loss_coef={KL_LOSS_COEF}",
        f"trainer.policy.optimizer_config.lr={LR}",
        "trainer.policy.optimizer_config.num_warmup_steps=0",
        "trainer.policy.megatron_config.runtime=cpu",
        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
        f"trainer.policy.megatron_config.checkpoint_cache_dir={cache}",
        "trainer.ref.megatron_config.runtime=cpu",
        f"trainer.ref.megatron_config.checkpoint_cache_dir={cache}",
        "trainer.remove_microbatch_padding=false",
        f"trainer.algorithm.max_seq_len={PROMPT + RESPONSE}",
    ])
    validate_config(cfg)
    return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    workdir = tmp_path_factory.mktemp("host04_actors")
    hf_dir = str(workdir / "qwen3")
    make_tiny_hf_model("qwen3", hf_dir, seed=11)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5, pad_token_id=tokenizer.pad_token_id)
    batch["response_mask"] = (batch["loss_mask"] > 0).long()
    host_logprobs = _host_hf_logprobs(hf_dir, batch)
    cfg = _config(hf_dir, workdir, mini_batch_prompts=PROMPTS)  # one mini-batch: one optimizer step
    start_ray_for_cpu_workers(num_gpus=3, num_cpus=3)
    try:
        trainer = host_trainer(cfg, tokenizer, total_training_steps=100)
        build_worker_groups(trainer)

        def data():
            return training_input(
                batch, RESPONSE, global_step=1,
                uids=[str(i // N_SAMPLES) for i in range(ROWS)],
                policy_mini_batch_boundaries=[(0, ROWS)],
            )

        yield trainer, data, batch, host_logprobs
    finally:
        ray.shutdown()


def test_the_hosts_trainer_built_our_groups_with_megatron_mesh_ranks(run):
    trainer, *_ = run
    ranks = [info.rank for info in trainer.policy_model.actor_infos]
    assert [(r.dp, r.sp, r.tp, r.pp, r.dp_size) for r in ranks] == [(0, 0, 0, 0, 1), (0, 0, 1, 0, 1)]
    assert repr(trainer.policy_model.actor_infos[0].handle).startswith("Actor(MegatronPolicyWorker,")
    assert repr(trainer.ref_model.actor_infos[0].handle).startswith("Actor(MegatronRefWorker,")


def test_scoring_and_one_training_step_through_forward_backward_and_optim_step(run):
    trainer, data, batch, host_logprobs = run
    mask = batch["loss_mask"].bool()
    scored = trainer.fwd_logprobs_values_reward(data())
    for key in ("action_log_probs", "base_action_log_probs"):
        diff = (scored[key] - host_logprobs).abs()[mask].max().item()
        assert diff <= LOGPROB_ATOL, f"{key}: {diff:.2e} from skyrl 0.4's HF wrapper"

    status = trainer.train_critic_and_policy(scored)
    for name in ("policy_loss", "final_loss", "policy_entropy", "policy_kl", "grad_norm", "policy_lr"):
        assert name in status, f"{name} missing from {sorted(status)}"
    # the old logprobs came from the same weights: ratio exactly 1, no clipping, no KL to the old policy
    assert status["ppo_kl"] == 0.0 and status["ppo_clip_ratio"] == 0.0
    # with ratio 1 the regular loss is minus the sum of the host's mini-batch-normalised advantages
    normalised = scored["advantages"]  # the trainer normalised them in place (token_mean: / tokens)
    assert normalised.abs().sum() < batch["advantages"].abs().sum()
    expected = -float((normalised * batch["loss_mask"]).sum())
    assert status["policy_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # the ref equals the policy before the step, so the k3 KL term is 0 too
    assert status["policy_kl"] == pytest.approx(0.0, abs=1e-7)
    assert math.isfinite(status["grad_norm"]) and status["grad_norm"] > 0
    assert status["policy_lr"] == pytest.approx(LR)

    after = trainer.fwd_logprobs_values_reward(data())
    moved = (after["action_log_probs"] - scored["action_log_probs"]).abs()[mask].max()
    assert moved > 1e-5, "the optimizer step did not move the policy"
    assert torch.equal(after["base_action_log_probs"], scored["base_action_log_probs"])  # the ref never trains
