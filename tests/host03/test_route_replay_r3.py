"""skyrl-train 0.3.1 refuses R3 routing replay by name (skyrl 0.4 takes it: tests/host04/test_skyrl04_r3_config.py).

The host-independent routing-replay tests: tests/test_route_replay.py.
"""

from __future__ import annotations

import pytest

from skyrl_megatron.config import ConfigError
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"


def problems_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


def test_r3_is_refused_on_skyrl_train_0_3_1(compose, hf_config_dir):
    """0.3.1's generator drops any engine's routes (skyrl 0.4 carries them: tests/host04)."""
    path = hf_config_dir("qwen3_moe")
    for engine in ("auto", "cpu"):
        msg = problems_of(compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config.routing_replay=r3", f"generator.engine={engine}"))
        assert f"{MC}.moe_config.routing_replay: no engine's routes reach the trainer on skyrl-train 0.3.1" in msg
        assert "use routing_replay=r2 (the policy's scoring routes replayed in training), or skyrl 0.4 for r3" in msg
