"""The composed config (host keys + megatron group) and one test per validation rule."""

from __future__ import annotations

import pytest

from skyrl_megatron.config import ConfigError, MegatronWorkerConfig
from skyrl_megatron.hosts import current
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"
# The rules below are checked against 4 GPUs per role and an engine of TP 4 (colocated, so the same GPUs):
# skyrl-train 0.3.1's default placement, stated so that skyrl 0.4 (default 1 GPU each) checks the same layouts.
FOUR_GPUS_PER_ROLE = (
    *(f"trainer.placement.{role}_num_gpus_per_node=4" for role in ("policy", "ref", "critic")),
    "generator.inference_engine_tensor_parallel_size=4",
)


@pytest.fixture
def compose(compose):
    def make(*overrides: str):
        return compose(*FOUR_GPUS_PER_ROLE, *overrides)

    return make


def problems_of(cfg, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, **kwargs)
    return str(info.value)


def _ours(cfg):
    """The composed config as our checks and workers read it (the host's own on skyrl-train 0.3.1)."""
    from skyrl_megatron.hosts import current

    return current().our_view(cfg)


# ---------------------------------------------------------------- composition


def test_composed_config_keeps_host_keys_and_adds_megatron_group(compose):
    host_cfg = compose()
    cfg = _ours(host_cfg)
    # host keys, untouched
    assert cfg.trainer.policy.optimizer_config.lr == 1.0e-6
    assert cfg.trainer.algorithm.advantage_estimator == "grpo"
    assert cfg.generator.n_samples_per_prompt > 0
    # the host's own megatron_config keys survive the merge (one both hosts have)
    assert host_cfg.trainer.policy.megatron_config.empty_cuda_cache is True
    # our group, for all three roles
    for role in ("policy", "ref", "critic"):
        mc = cfg.trainer[role].megatron_config
        assert mc.runtime == "auto"
        assert role == "ref" or mc.compact_master_weights == "auto"  # (the reference has no optimizer)
        assert mc.virtual_pipeline_model_parallel_size is None
        assert "checkpoint_cache_dir" in mc
    assert cfg.trainer.strategy == "megatron"
    # recompute: off by default on skyrl-train 0.3.1 (our config overrides its full recompute); skyrl 0.4's
    # typed defaults are its own, full recompute included (README, Host versions)
    from skyrl_megatron.hosts import current
    from skyrl_megatron.hosts.skyrl_train_0_3 import SkyRLTrain03

    default = None if isinstance(current(), SkyRLTrain03) else "full"
    assert cfg.trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity == default


def test_cli_overrides_reach_host_and_megatron_keys(compose):
    cfg = compose(
        "trainer.policy.optimizer_config.lr=3e-6",
        f"{MC}.tensor_model_parallel_size=2",
        f"{MC}.transformer_config_kwargs.recompute_granularity=full",
        f"{MC}.ddp_config.overlap_grad_reduce=true",
        "trainer.strategy=fsdp2",
    )
    cfg = _ours(cfg)
    assert cfg.trainer.policy.optimizer_config.lr == 3e-6
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 2
    assert cfg.trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity == "full"
    assert cfg.trainer.policy.megatron_config.ddp_config.overlap_grad_reduce is True
    assert cfg.trainer.strategy == "fsdp2"
    typed = MegatronWorkerConfig.from_host_config(cfg, "policy")
    assert typed.parallel().tensor == 2 and typed.parallel().sequence_parallel
    # the host's own transformer_config_kwargs defaults (none on 0.3.1; 0.4 has some) with ours on top
    defaults = MegatronWorkerConfig.from_host_config(_ours(compose()), "policy").transformer_overrides()
    assert typed.transformer_overrides() == {**defaults, "recompute_granularity": "full"}


def test_valid_config_passes_ours_and_the_hosts_checks(compose, hf_config_dir):
    cfg = compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.tensor_model_parallel_size=2")
    validate_config(cfg)  # must not raise


# ---------------------------------------------------------------- one test per rule


def test_unknown_strategy_names_the_closest(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", "trainer.strategy=megatorn"))
    assert "trainer.strategy" in msg and "'megatorn'" in msg and "did you mean 'megatron'" in msg


def _ppo(path: str, *overrides: str) -> list[str]:
    """PPO with GAE: policy (4 ranks, TP1) and a critic from the same checkpoint."""
    return [f"trainer.policy.model.path={path}", f"trainer.critic.model.path={path}",
            "trainer.algorithm.advantage_estimator=gae", *overrides]


def test_a_megatron_critic_passes_ours_and_the_hosts_checks(compose, hf_config_dir):
    cfg = compose(*_ppo(hf_config_dir(), "trainer.critic.megatron_config.tensor_model_parallel_size=2"))
    validate_config(cfg)  # the host's "only GRPO training is currently supported for megatron" is lifted
    typed = MegatronWorkerConfig.from_host_config(_ours(cfg), "critic")
    assert typed.parallel().tensor == 2


def test_critic_batch_sizes_are_checked_against_the_megatron_critics_dp_size(compose, hf_config_dir):
    # critic on 4 ranks at TP=2 x PP=2 is DP 1: 1 prompt x 2 samples = 2 rows per rank, 1 micro-batch of 2
    sizes = ["trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "trainer.critic_mini_batch_size=1",
             "generator.n_samples_per_prompt=2", "trainer.micro_train_batch_size_per_gpu=2"]
    cfg = compose(*_ppo(hf_config_dir(), *sizes, "trainer.critic.megatron_config.tensor_model_parallel_size=2",
                        "trainer.critic.megatron_config.pipeline_model_parallel_size=2"))
    validate_config(cfg)
    assert cfg.trainer.critic.sequence_parallel_size == 1  # the host saw our DP size only while checking
    # at TP=PP=1 the same critic is DP 4: half a row per rank
    msg = problems_of(compose(*_ppo(hf_config_dir(), *sizes)))
    assert "critic_mini_batch_size_per_gpu" in msg


def test_critic_settings_the_megatron_critic_does_not_take_are_named(compose, hf_config_dir):
    msg = problems_of(compose(*_ppo(hf_config_dir(), "trainer.critic.model.lora.rank=8",
                                    "trainer.critic.sequence_parallel_size=2", "trainer.algorithm.value_clip=-1")),
                      run_host_checks=False)
    assert "trainer.critic.model.lora.rank: LoRA on the Megatron critic is not supported" in msg
    assert "set trainer.critic.sequence_parallel_size=1" in msg
    assert "trainer.algorithm.value_clip: must be a positive number or null" in msg


def test_the_critic_layout_is_checked_like_the_policys(compose, hf_config_dir):
    msg = problems_of(compose(*_ppo(hf_config_dir(), "trainer.critic.megatron_config.pipeline_model_parallel_size=3")),
                      run_host_checks=False)
    assert "trainer.critic.megatron_config" in msg and "critic world size 4" in msg


def test_missing_model_path(compose):
    msg = problems_of(compose("trainer.policy.model.path=null"))
    assert "trainer.policy.model.path: no model path is set" in msg


def test_nonexistent_model_path(compose, tmp_path):
    msg = problems_of(compose(f"trainer.policy.model.path={tmp_path}/nope"))
    assert f"'{tmp_path}/nope' does not exist" in msg and "trainer.policy.model.path" in msg
    assert msg.count("does not exist") == 1  # the ref inherits the path: reported once


def test_world_size_not_divisible(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.pipeline_model_parallel_size=3"))
    assert "policy world size 4" in msg and "not divisible by TP*PP*CP = 1*3*1 = 3" in msg


def test_heads_not_divisible_by_tp(compose, hf_config_dir):
    path = hf_config_dir(num_attention_heads=6, num_key_value_heads=6, head_dim=16)
    msg = problems_of(
        compose(f"trainer.policy.model.path={path}", f"{MC}.tensor_model_parallel_size=4")
    )
    assert "6 attention heads are not divisible by TP=4" in msg


def test_query_groups_not_divisible_by_tp(compose, hf_config_dir):
    path = hf_config_dir(num_attention_heads=4, num_key_value_heads=2)
    msg = problems_of(compose(f"trainer.policy.model.path={path}", f"{MC}.tensor_model_parallel_size=4"))
    assert "2 key/value heads (query groups) are not divisible by TP=4" in msg
    assert "attention heads are not divisible" not in msg


def test_layers_not_divisible_by_pp_times_vpp(compose, hf_config_dir):
    path = hf_config_dir(num_hidden_layers=6)
    msg = problems_of(
        compose(
            f"trainer.policy.model.path={path}",
            f"{MC}.pipeline_model_parallel_size=2",
            f"{MC}.virtual_pipeline_model_parallel_size=2",
        )
    )
    assert "6 layers do not split evenly into PP*VPP = 2*2 = 4 stages" in msg


def test_vpp_needs_pp(compose, hf_config_dir):
    msg = problems_of(
        compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.virtual_pipeline_model_parallel_size=2")
    )
    assert "virtual pipeline stages (2) need pipeline_model_parallel_size > 1" in msg


def test_experts_not_divisible_by_ep(compose, hf_config_dir):
    path = hf_config_dir("qwen3_moe", num_experts=6)
    msg = problems_of(compose(f"trainer.policy.model.path={path}", f"{MC}.expert_model_parallel_size=4"))
    assert "6 experts are not divisible by EP=4" in msg


def test_expert_parallel_on_dense_model(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.expert_model_parallel_size=2"))
    assert "expert parallelism (2) was asked for, but qwen3 is a dense model" in msg


def test_context_parallel_without_packing(compose, hf_config_dir):
    msg = problems_of(
        compose(
            f"trainer.policy.model.path={hf_config_dir()}",
            f"{MC}.context_parallel_size=2",
            "trainer.use_sample_packing=false",
        )
    )
    assert "context parallelism (2) splits packed sequences and needs sample packing" in msg
    # the fix names the packing flag as the installed host spells it (skyrl 0.4: remove_microbatch_padding)
    packing = current().host_key_names().get("trainer.use_sample_packing", "trainer.use_sample_packing")
    assert f"Fix: set {packing}=true or context_parallel_size=1" in msg


@pytest.mark.parametrize(
    "section,typo,suggestion,dataclass",
    [
        ("ddp_config", "grad_reduce_in_fp3", "grad_reduce_in_fp32", "DistributedDataParallelConfig"),
        ("optimizer_config_kwargs", "adam_bta1", "adam_beta1", "OptimizerConfig"),
        ("transformer_config_kwargs", "recompute_granularty", "recompute_granularity", "TransformerConfig"),
    ],
)
def test_unknown_pass_through_key_names_the_closest_field(compose, hf_config_dir, section, typo, suggestion, dataclass):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.{section}.{typo}=1"))
    assert f"{MC}.{section}.{typo}: not a field of Megatron's {dataclass}" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_megatron_key_names_the_closest(compose, hf_config_dir):
    # skyrl-train 0.3.1 composes it and our checks refuse it; skyrl 0.4's typed config refuses it in composing
    with pytest.raises(ConfigError) as info:
        validate_config(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.tensor_parallel_size=2"))
    msg = str(info.value)
    assert f"{MC}.tensor_parallel_size: unknown key" in msg and "did you mean 'tensor_model_parallel_size'" in msg


def test_every_problem_is_reported_at_once(compose, hf_config_dir):
    path = hf_config_dir(num_hidden_layers=6)
    msg = problems_of(
        compose(
            f"trainer.policy.model.path={path}",
            f"{MC}.pipeline_model_parallel_size=4",
            "trainer.ref.megatron_config.tensor_model_parallel_size=3",
        )
    )
    assert "(3 problems)" in msg or "(4 problems)" in msg
    assert "trainer.ref.megatron_config" in msg and "6 layers" in msg


def test_host_rules_still_apply(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", "trainer.train_batch_size=100", "trainer.policy_mini_batch_size=64"))
    assert "(host check)" in msg and "train_batch_size" in msg


def test_megatron_field_names_read_from_source_equal_the_dataclasses():
    """Validation reads the pass-through sections' field names without importing Megatron."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from skyrl_megatron.megatron_fields import section_fields

    classes = {c.__name__: c for c in (DistributedDataParallelConfig, OptimizerConfig, TransformerConfig)}
    fields = section_fields()
    assert set(fields) == {"ddp_config", "optimizer_config_kwargs", "transformer_config_kwargs"}
    for section, (name, names) in fields.items():
        assert names == {f.name for f in dataclasses.fields(classes[name])}, section


def test_keeping_the_cuda_cache_is_refused_where_the_gpus_are_shared(compose, hf_config_dir):
    path = f"trainer.policy.model.path={hf_config_dir()}"
    keep = f"{MC}.empty_cuda_cache=false"
    msg = problems_of(compose(path, keep, "trainer.placement.colocate_all=true"))
    assert f"{MC}.empty_cuda_cache: false keeps this worker's CUDA cache while trainer.placement.colocate_all" in msg
    msg = problems_of(compose(path, "trainer.placement.colocate_all=false", "trainer.placement.colocate_policy_ref=true",
                              "trainer.ref.megatron_config.empty_cuda_cache=false"))
    assert "trainer.ref.megatron_config.empty_cuda_cache: false keeps" in msg and "colocate_policy_ref" in msg
    apart = ("trainer.placement.colocate_all=false", "trainer.placement.colocate_policy_ref=false")
    validate_config(compose(path, keep, *apart))  # GPUs of its own: nothing to refuse


def test_switches_must_be_booleans_and_sizes_positive(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.manual_gc=sometimes",
                              f"{MC}.empty_cuda_cache=1", f"{MC}.logits_chunk_mib=0", f"{MC}.overlap_optimizer_backload=2"))
    assert f"{MC}.manual_gc: must be true or false, got 'sometimes'" in msg
    assert f"{MC}.overlap_optimizer_backload: must be true or false, got 2" in msg
    assert f"{MC}.empty_cuda_cache: must be true or false, got 1" in msg
    assert f"{MC}.logits_chunk_mib: must be a positive integer, got 0" in msg
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.forward_max_tokens_per_microbatch=-5"))
    assert f"{MC}.forward_max_tokens_per_microbatch: must be a positive integer or null, got -5" in msg


def test_fault_handling_keys_are_checked(compose, hf_config_dir):
    path = f"trainer.policy.model.path={hf_config_dir()}"
    msg = problems_of(compose(path, f"{MC}.async_save=maybe", f"{MC}.collective_timeout_s=0",
                              "trainer.ref.megatron_config.collective_timeout_s=-1", "trainer.preemption_signal=SIGTREM",
                              "trainer.algorithm.use_kl_loss=true"))
    assert f"{MC}.async_save: must be true or false, got 'maybe'" in msg
    assert f"{MC}.collective_timeout_s: must be a number of seconds > 0, got 0" in msg
    assert "trainer.ref.megatron_config.collective_timeout_s: must be a number of seconds > 0, got -1" in msg
    assert "trainer.preemption_signal: unknown signal 'SIGTREM'. Fix: use one of SIGTERM, SIGUSR1, SIGUSR2, SIGINT, " \
           "or null to leave signals alone (did you mean 'SIGTERM'?)" in msg
    msg = problems_of(compose(path, "trainer.ref.megatron_config.async_save=true", "trainer.algorithm.use_kl_loss=true"))
    assert "trainer.ref.megatron_config.async_save: the reference model saves no checkpoints" in msg
    cfg = compose(path, f"{MC}.async_save=true", f"{MC}.collective_timeout_s=30", "trainer.preemption_signal=SIGUSR1")
    validate_config(cfg)
    worker = MegatronWorkerConfig.from_host_config(_ours(cfg), "policy")
    assert (worker.async_save, worker.collective_timeout_s) == (True, 30)
    assert _ours(cfg).trainer.preemption_signal == "SIGUSR1"
    defaults = _ours(compose(path))
    assert defaults.trainer.preemption_signal == "SIGTERM"
    assert MegatronWorkerConfig.from_host_config(defaults, "policy").collective_timeout_s == 600


@pytest.mark.parametrize("settings,named", [
    (["recompute_granularity=full", "recompute_method=sideways", "recompute_num_layers=1"],
     "transformer_config_kwargs.recompute_method: full recompute needs uniform or block, got 'sideways'"),
    (["recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=0"],
     "transformer_config_kwargs.recompute_num_layers: full recompute needs a positive number of layers, got 0"),
    (["recompute_granularity=everything"],
     "transformer_config_kwargs.recompute_granularity: must be full, selective or null, got 'everything'"),
])
def test_activation_recompute_is_checked_before_a_model_is_built(compose, hf_config_dir, settings, named):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir()}",
                              *(f"{MC}.transformer_config_kwargs.{s}" for s in settings)))
    assert named in msg, msg


def test_recompute_companions_count_only_with_their_granularity():
    """skyrl 0.4's defaults (full recompute, uniform over 1 layer) stay merged into a user's selective or null:
    Megatron gets what that granularity takes (it refuses recompute_num_layers with selective)."""
    host_defaults = {"recompute_granularity": "full", "recompute_modules": ["core_attn"], "recompute_method": "uniform",
                     "recompute_num_layers": 1, "gradient_accumulation_fusion": False}

    def overrides(**changes):
        return MegatronWorkerConfig(transformer_config_kwargs={**host_defaults, **changes}).transformer_overrides()

    assert overrides() == host_defaults
    assert overrides(recompute_granularity="selective") == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn"], "gradient_accumulation_fusion": False}
    assert overrides(recompute_granularity=None) == {"gradient_accumulation_fusion": False}
    from megatron.core.transformer.transformer_config import TransformerConfig

    for granularity in ("full", "selective", None):  # each is a TransformerConfig Megatron accepts
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **overrides(recompute_granularity=granularity))


def test_gradient_accumulation_fusion_stays_megatron_bridges_default_unless_the_command_line_names_it(compose):
    """skyrl 0.4's defaults set transformer_config_kwargs.gradient_accumulation_fusion=false (its own backend has the
    fused weight-gradient GEMM only through APEX or Transformer Engine); ours has it in PyTorch, on by default
    (test_wgrad.py builds with the key absent). Neither host's defaults turn it off for us; a user still can."""
    key = "gradient_accumulation_fusion"

    def worker_settings(cfg, role):  # what a worker reads, through the host's adapter
        return MegatronWorkerConfig.from_host_config(current().our_view(cfg), role)

    for extra in ((), (f"{MC}.transformer_config_kwargs.recompute_granularity=null",)):
        cfg = compose(*extra)
        for role in ("policy", "ref", "critic"):
            assert key not in worker_settings(cfg, role).transformer_overrides(), (role, extra)
    for value in (False, True):
        cfg = compose(f"{MC}.transformer_config_kwargs.{key}={str(value).lower()}")
        assert worker_settings(cfg, "policy").transformer_overrides()[key] is value


def test_the_reference_must_take_its_logprobs_from_the_same_head_as_the_policy(compose, hf_config_dir):
    path = f"trainer.policy.model.path={hf_config_dir()}"
    ref = "trainer.ref.megatron_config.fused_kernels"
    two_kernels = "[rope,qk_norm_rope,swiglu,logprobs]"
    msg = problems_of(compose(path, "trainer.algorithm.use_kl_loss=true", f"{ref}={two_kernels}"))  # the policy's default
    assert (f"{ref}: the policy takes its logprobs from the head's epilogue GEMM (lse_gemm) but the reference does not: "
            "their logprobs would differ by the logits' rounding, a KL between equal weights. Fix: add lse_gemm to "
            f"{ref}, or remove it from {MC}.fused_kernels") in msg
    msg = problems_of(compose(path, "trainer.algorithm.use_kl_loss=true", f"{MC}.fused_kernels={two_kernels}"))
    assert f"{ref}: the reference takes its logprobs from the head's epilogue GEMM (lse_gemm) but the policy does not" in msg
    # a bad list is named alone (the heads are compared once both lists are valid)
    msg = problems_of(compose(path, "trainer.algorithm.use_kl_loss=true", f"{MC}.fused_kernels=[rope,swigl]"))
    assert "unknown kernel 'swigl'" in msg and "epilogue GEMM" not in msg
    # both heads alike (the defaults, or both without it), or no reference model at all: nothing to compare
    validate_config(compose(path, "trainer.algorithm.use_kl_loss=true"))
    validate_config(compose(path, "trainer.algorithm.use_kl_loss=true", f"{MC}.fused_kernels={two_kernels}", f"{ref}={two_kernels}"))
    validate_config(compose(path, "trainer.algorithm.use_kl_loss=false", "trainer.algorithm.use_kl_in_reward=false",
                            f"{ref}={two_kernels}"))


@pytest.mark.parametrize("role", ["policy", "ref", "critic"])
def test_the_yaml_groups_default_as_the_typed_config_does(role):
    """skyrl-train 0.3.1 composes its defaults from `config/megatron/<role>.yaml`, skyrl 0.4 from the dataclass: a
    default changed in one and not the other would make the two hosts train differently. The pass-through dicts are
    spelled out in the YAML (the host's own keys) and left empty in the dataclass, so they are left out here."""
    import dataclasses
    from pathlib import Path

    import yaml

    data = yaml.safe_load((Path(__file__).parents[1] / "config" / "megatron" / f"{role}.yaml").read_text())
    from_yaml, default = MegatronWorkerConfig.from_mapping(data), MegatronWorkerConfig()
    pass_through = {"ddp_config", "optimizer_config_kwargs", "transformer_config_kwargs"}
    for field in dataclasses.fields(MegatronWorkerConfig):
        if field.name not in pass_through:
            assert getattr(from_yaml, field.name) == getattr(default, field.name), field.name
