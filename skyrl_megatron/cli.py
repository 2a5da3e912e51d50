"""The `skyrl-megatron` command: the host's PPO/GRPO training with Megatron workers.

    skyrl-megatron trainer.policy.model.path=/ckpt/Qwen3-0.6B \
        trainer.policy.megatron_config.tensor_model_parallel_size=2 ...

The config is the host's ``ppo_base_config`` plus our ``megatron`` group (see
``config/skyrl_megatron.yaml``); every Hydra flag works (``--help``, ``--cfg job``, ...).
``skyrl-megatron plan ...`` is the memory planner instead (``skyrl_megatron/planner``).
"""

from __future__ import annotations

import re
import sys
from importlib import resources

import hydra

from skyrl_megatron.config import ConfigError
from skyrl_megatron.validation import validate_config

CONFIG_NAME = "skyrl_megatron"

# Keys inside a worker's megatron_config are checked by our validator, which names the closest valid
# key on a typo. Hydra's struct mode would reject such a key first with a less helpful message, so
# overrides of these keys are passed to Hydra as add-or-override ("++").
_MEGATRON_KEY = re.compile(r"^trainer\.(policy|ref|critic)\.megatron_config\.[^=]+=")


def config_dir() -> str:
    return str(resources.files("skyrl_megatron.conf"))


def _normalise_overrides(argv: list[str]) -> list[str]:
    return [f"++{arg}" if _MEGATRON_KEY.match(arg) else arg for arg in argv]


def compose_config(overrides: list[str] | None = None):
    """The config `skyrl-megatron` would run with, for programs and tests (no Hydra app, no side effects)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="skyrl_megatron"):
        return compose(config_name=CONFIG_NAME, overrides=_normalise_overrides(list(overrides or [])))


def report_config_error(err: ConfigError) -> None:
    print(f"skyrl-megatron: {err}", file=sys.stderr)


@hydra.main(config_path=config_dir(), config_name=CONFIG_NAME, version_base="1.3")
def _train(cfg) -> None:
    try:
        validate_config(cfg)
    except ConfigError as err:
        report_config_error(err)
        sys.exit(2)
    from skyrl_megatron.host import run_experiment

    run_experiment(cfg)


def main() -> None:
    if sys.argv[1:2] == ["plan"]:  # the memory planner has its own flags; Hydra never sees them
        from skyrl_megatron.planner.cli import main as plan

        sys.exit(plan(sys.argv[2:]))
    sys.argv = [sys.argv[0], *_normalise_overrides(sys.argv[1:])]
    _train()


if __name__ == "__main__":
    main()
