"""Our critic as Ray actors, driven by skyrl 0.4's own trainer (CPU, fp32): PPO's critic half.

skyrl 0.4's `RayPPOTrainer.build_models` creates a DP2 critic group of two actors beside a one-rank
policy; `fwd_logprobs_values_reward` fills the batch's values through the critic's `forward`, and
`train_critic_and_policy` stages each DP rank's rows of the critic mini-batch and calls our
`forward_backward` + `optim_step` (0.4's critic contract) before the policy's. The reference is
skyrl 0.4's own HF critic (`get_llm_for_sequence_regression`) holding the head our worker draws,
trained the way 0.4's critic trains: its `ppo_critic_loss` per micro-batch, gradients averaged
over micro-batches and DP ranks. The config tests check that 0.4's validation takes a Megatron
critic: its batch-size rules get the critic's Megatron DP size, and our critic rules apply.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model
from skyrl_megatron.testing.critic_steps import synthetic_returns
from skyrl_megatron.testing.host_trainer import build_worker_groups, host_trainer, start_ray_for_cpu_workers, training_input

ROWS, PROMPT, RESPONSE = 8, 6, 6
N_SAMPLES, PROMPTS = 2, 4
MICRO = 2  # rows per micro-batch: each DP rank's 4 rows are 2 micro-batches
SEED = 7
LR = 1e-3
VALUE_ATOL = 1e-5
# what 0.4's critic forward_backward reports, and the grad norm its trainer adds from optim_step
HOST_CRITIC_METRICS = ("critic_loss", "values_mean", "values_clipfrac", "critic_lr", "grad_norm")


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config

    cfg = compose_config([
        "trainer.strategy=megatron",
        f"trainer.policy.model.path={hf_dir}",
        f"trainer.critic.model.path={hf_dir}",
        "trainer.algorithm.advantage_estimator=gae",
        "trainer.algorithm.use_kl_loss=false",  # no reference group: policy (1 rank) and critic (2)
        f"trainer.ckpt_path={workdir}/ckpt",
        f"trainer.export_path={workdir}/export",
        "trainer.logger=console",
        f"trainer.seed={SEED}",
        "trainer.bf16=false",
        "trainer.placement.colocate_all=false",
        "trainer.placement.policy_num_gpus_per_node=1",
        "trainer.placement.critic_num_gpus_per_node=2",
        f"generator.n_samples_per_prompt={N_SAMPLES}",
        f"trainer.train_batch_size={PROMPTS}",
        f"trainer.policy_mini_batch_size={PROMPTS}",
        f"trainer.critic_mini_batch_size={PROMPTS}",  # one critic mini-batch: one optimizer step
        f"trainer.micro_train_batch_size_per_gpu={MICRO}",
        f"trainer.micro_forward_batch_size_per_gpu={MICRO}",
        f"trainer.critic.optimizer_config.lr={LR}",
        "trainer.critic.optimizer_config.num_warmup_steps=0",
        "trainer.policy.megatron_config.runtime=cpu",
        "trainer.critic.megatron_config.runtime=cpu",
        f"trainer.policy.megatron_config.checkpoint_cache_dir={workdir}/conversion_cache",
        f"trainer.critic.megatron_config.checkpoint_cache_dir={workdir}/conversion_cache",
        "trainer.remove_microbatch_padding=false",
        f"trainer.algorithm.max_seq_len={PROMPT + RESPONSE}",
    ])
    validate_config(cfg)  # ours and the host's, its Megatron critic ban lifted
    return cfg


def _critic_args(hf_dir: str, tp: int, mini_batch_prompts: int) -> list[str]:
    return [
        "trainer.strategy=megatron",
        f"trainer.policy.model.path={hf_dir}",
        f"trainer.critic.model.path={hf_dir}",
        "trainer.algorithm.advantage_estimator=gae",
        "trainer.logger=console",
        "trainer.placement.colocate_all=false",
        "trainer.placement.critic_num_gpus_per_node=2",
        f"generator.n_samples_per_prompt={N_SAMPLES}",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        f"trainer.critic_mini_batch_size={mini_batch_prompts}",
        f"trainer.micro_train_batch_size_per_gpu={MICRO}",
        "trainer.policy.megatron_config.runtime=cpu",
        "trainer.critic.megatron_config.runtime=cpu",
        f"trainer.critic.megatron_config.tensor_model_parallel_size={tp}",
    ]


def test_the_hosts_batch_size_rules_get_the_megatron_critics_dp_size(hf_config_dir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.validation import validate_config

    hf_dir = hf_config_dir()
    # TP2 on 2 GPUs is DP 1: 1 prompt x 2 samples = 2 rows per rank, one micro-batch (the host's
    # FSDP view, DP 2, would have 1 row per rank and refuse it)
    cfg = compose_config(_critic_args(hf_dir, tp=2, mini_batch_prompts=1))
    validate_config(cfg)
    assert cfg.trainer.critic.sequence_parallel_size == 1  # put back after the host's checks
    # TP1 on 2 GPUs is DP 2: 1 row per rank, less than a micro-batch; the host's rule says so
    with pytest.raises(ConfigError, match=r"\(host check\): normalized critic_mini_batch_size_per_gpu 1 should be divisible"):
        validate_config(compose_config(_critic_args(hf_dir, tp=1, mini_batch_prompts=1)))


def test_our_critic_rules_apply_on_0_4(hf_config_dir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.validation import validate_config

    args = _critic_args(hf_config_dir(), tp=2, mini_batch_prompts=2)
    with pytest.raises(ConfigError, match=r"trainer.critic.model.lora.rank: LoRA on the Megatron critic is not supported"):
        validate_config(compose_config(args + ["trainer.critic.model.lora.rank=8"]))
    with pytest.raises(ConfigError, match=r"trainer.algorithm.value_clip: must be a positive number or null"):
        validate_config(compose_config(args + ["trainer.algorithm.value_clip=-1"]))


def _host_critic(hf_dir: str):
    """skyrl 0.4's own HF critic (fp32) with the value head our worker draws for this checkpoint."""
    from skyrl_megatron.activation import activate

    activate()  # the host imports flash_attn's padding helpers (flash-attn without its CUDA build here)
    from skyrl.backends.skyrl_train.workers.model_wrapper import get_llm_for_sequence_regression

    from skyrl_megatron.model.adapters.value_head import ValueHeadInit

    model = get_llm_for_sequence_regression(hf_dir, "critic", bf16=False, init_value_head=True)
    head = ValueHeadInit.for_checkpoint(hf_dir, policy_path=hf_dir, seed=SEED).make_weight(torch.float32)
    with torch.no_grad():
        model.value_head.weight.copy_(head)
    return model


def _host_reference(hf_dir: str, batch, returns: torch.Tensor) -> dict:
    """Values, and the loss and grad norm of one critic mini-batch step as skyrl 0.4's critic takes it:
    `ppo_critic_loss` per micro-batch (old values = the scored ones), gradients summed, then scaled by
    1 / micro-batches on each DP rank and averaged over the DP ranks."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_critic_loss
    from skyrl.train.config.config import AlgorithmConfig

    model = _host_critic(hf_dir)
    with torch.no_grad():
        values = model(batch["sequences"], RESPONSE, batch["attention_mask"]).float()
    algorithm = AlgorithmConfig()
    losses = []
    model.zero_grad()
    micro_batches = ROWS // MICRO  # over both DP ranks: each rank's 1/2 x DP's 1/2 = 1/4 each
    for start in range(0, ROWS, MICRO):
        rows = slice(start, start + MICRO)
        new = model(batch["sequences"][rows], RESPONSE, batch["attention_mask"][rows])
        loss, _ = ppo_critic_loss(new, values[rows], returns[rows], config=algorithm, loss_mask=batch["loss_mask"][rows])
        (loss / micro_batches).backward()
        losses.append(float(loss.detach()))
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {"values": values, "critic_loss": sum(losses) / len(losses), "grad_norm": float(grad_norm)}


def _value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    return float((((values - returns) ** 2) * mask).sum() / mask.sum())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    workdir = tmp_path_factory.mktemp("host04_critic")
    hf_dir = str(workdir / "qwen3")
    make_tiny_hf_model("qwen3", hf_dir, seed=11)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5, pad_token_id=tokenizer.pad_token_id)
    batch["response_mask"] = (batch["loss_mask"] > 0).long()
    returns = synthetic_returns(batch["loss_mask"], seed=5)
    reference = _host_reference(hf_dir, batch, returns)
    cfg = _config(hf_dir, workdir)
    start_ray_for_cpu_workers(num_gpus=3, num_cpus=3)
    try:
        trainer = host_trainer(cfg, tokenizer, total_training_steps=100)
        build_worker_groups(trainer)

        def data():
            return training_input(
                batch, RESPONSE, global_step=1,
                uids=[str(i // N_SAMPLES) for i in range(ROWS)],
                policy_mini_batch_boundaries=[(0, ROWS)],
                critic_mini_batch_boundaries=[(0, ROWS)],
            )

        yield trainer, data, batch, returns, reference
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_the_hosts_trainer_built_our_critic_group_with_megatron_mesh_ranks(run):
    trainer, *_ = run
    ranks = [info.rank for info in trainer.critic_model.actor_infos]
    assert [(r.dp, r.sp, r.tp, r.pp, r.dp_size) for r in ranks] == [(0, 0, 0, 0, 2), (1, 0, 0, 0, 2)]
    assert repr(trainer.critic_model.actor_infos[0].handle).startswith("Actor(MegatronCriticWorker,")


@pytest.mark.slow
def test_values_and_one_critic_step_through_forward_backward_and_optim_step(run):
    trainer, data, batch, returns, reference = run
    mask = batch["loss_mask"].bool()
    scored = trainer.fwd_logprobs_values_reward(data())
    values = scored["values"]
    assert values.shape == (ROWS, RESPONSE)
    diff = (values - reference["values"]).abs()[mask].max().item()
    assert diff <= VALUE_ATOL, f"values {diff:.2e} from skyrl 0.4's HF critic"
    assert values[~mask].abs().max().item() == 0.0  # 0 past a response's end

    scored["returns"] = returns
    trainer.all_metrics = {}
    trainer.train_critic_and_policy(scored)
    critic = {k.removeprefix("critic/"): v for k, v in trainer.all_metrics.items() if k.startswith("critic/")}
    missing = [name for name in HOST_CRITIC_METRICS if name not in critic]
    assert not missing, f"critic metrics lack {missing}: {sorted(critic)}"
    # 0.4's value loss over the mini-batch (both DP ranks' rows) and its gradient's norm
    assert critic["critic_loss"] == pytest.approx(reference["critic_loss"], rel=1e-5)
    assert critic["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    assert critic["critic_lr"] == pytest.approx(LR)
    assert critic["values_mean"] == pytest.approx(float(reference["values"][mask].mean()), abs=1e-5)
    assert 0.0 <= critic["values_clipfrac"] <= 1.0

    # the step moved the values towards the returns (and the policy's step did not touch the critic)
    after = trainer.fwd_logprobs_values_reward(data())["values"]
    assert (after - values).abs()[mask].max() > 1e-5, "the optimizer step did not move the critic"
    assert _value_loss(after, returns, mask) < _value_loss(values, returns, mask)
