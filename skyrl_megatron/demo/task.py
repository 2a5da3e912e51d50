"""The demo's task: a skyrl-gym environment with a verifiable reward, and its prompt dataset.

A freshly initialised tiny model cannot do arithmetic, so the task must give a learning signal from
the first step: the reward is the share of the reply's characters that are digits. It is verifiable
(a pure function of the reply), dense (a random reply scores a few percent, not zero) and has a
clear optimum (1.0: digits only), so "reward goes up" is visible within a few GRPO steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

# where in a run directory the demo writes its prompt file
DEMO_PROMPTS = Path("data") / "prompts.jsonl"

ENV_ID = "skyrl_megatron_digits"
INSTRUCTIONS = ("Reply with digits only.", "Digits please:", "Answer in digits.", "Only numbers:")


def digit_share(reply: str) -> float:
    """The reward: digits over all characters of the reply (0 for an empty reply)."""
    return sum(ch.isdigit() for ch in reply) / len(reply) if reply else 0.0


class DigitsEnv(BaseTextEnv):
    """One turn: the reply is scored and the episode ends."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None):
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=digit_share(action), done=True, metadata={})


def register_environment() -> None:
    """Register the environment with skyrl-gym (idempotent): the host's generator makes it by name."""
    from skyrl_gym.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point=f"{__name__}:DigitsEnv")


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """A JSONL prompt file in the host's dataset format (chat messages + env_class)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for index in range(count):
            prompt = f"{rng.choice(INSTRUCTIONS)} #{index}"
            out.write(json.dumps({"prompt": [{"role": "user", "content": prompt}], "env_class": ENV_ID}) + "\n")
    return path
