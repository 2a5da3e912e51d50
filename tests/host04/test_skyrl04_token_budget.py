"""skyrl 0.4's trainer-level token budget reaches our workers.

skyrl 0.4's own Megatron and FSDP workers pack micro-batches by ``trainer.max_tokens_per_microbatch``; ours
by ``trainer.<role>.megatron_config.max_tokens_per_microbatch``. A user switching to
``trainer.strategy=megatron`` keeps the host's key: it fills every role that leaves ours unset (without
it, micro-batches silently fall back to ``micro_*_batch_size_per_gpu`` rows), and a role's own value wins.
"""

from __future__ import annotations

import pytest

from skyrl_megatron.config import MegatronWorkerConfig
from skyrl_megatron.hosts import current
from skyrl_megatron.validation import validate_config


@pytest.fixture
def policy_model(hf_config_dir):
    return f"trainer.policy.model.path={hf_config_dir('qwen3')}"


def _budgets(cfg) -> dict[str, int | None]:
    view = current().our_view(cfg)
    return {role: MegatronWorkerConfig.from_host_config(view, role).max_tokens_per_microbatch
            for role in ("policy", "ref", "critic")}


def test_the_hosts_budget_fills_every_role_that_leaves_ours_unset(compose, policy_model):
    cfg = compose("trainer.strategy=megatron", policy_model, "trainer.max_tokens_per_microbatch=8192",
                  "trainer.ref.megatron_config.max_tokens_per_microbatch=16384")
    assert _budgets(cfg) == {"policy": 8192, "ref": 16384, "critic": 8192}
    validate_config(cfg)


def test_without_the_hosts_budget_ours_stay_as_set(compose, policy_model):
    cfg = compose("trainer.strategy=megatron", policy_model, "trainer.policy.megatron_config.max_tokens_per_microbatch=4096")
    assert _budgets(cfg) == {"policy": 4096, "ref": None, "critic": None}
    assert cfg.trainer.max_tokens_per_microbatch == -1  # the host's "off"


def test_another_strategy_keeps_the_hosts_key_to_itself(compose, policy_model):
    cfg = compose("trainer.strategy=fsdp2", policy_model, "trainer.max_tokens_per_microbatch=8192")
    assert cfg.trainer.policy.megatron_config.max_tokens_per_microbatch is None
