"""The `skyrl-megatron` command: the host's PPO/GRPO training with Megatron workers.

    skyrl-megatron trainer.policy.model.path=/ckpt/Qwen3-0.6B \
        trainer.policy.megatron_config.tensor_model_parallel_size=2 ...

The same overrides work on both hosts. On skyrl-train 0.3.1 the config is the host's
``ppo_base_config`` plus our ``megatron`` group (``config/skyrl_megatron.yaml``), composed by Hydra, so
every Hydra flag works (``--help``, ``--cfg job``, ...). On skyrl 0.4 it is the host's typed
``SkyRLTrainConfig`` extended with our keys. ``skyrl-megatron plan ...`` is the memory planner instead
(``skyrl_megatron/planner``).
"""

from __future__ import annotations

import sys

from skyrl_megatron import exit_codes
from skyrl_megatron.config import ConfigError
from skyrl_megatron.hosts import current


def compose_config(overrides: list[str] | None = None):
    """The config `skyrl-megatron` would run with, for programs and tests (no side effects)."""
    return current().compose_config(list(overrides or []))


def checked_config(overrides: list[str]):
    """The config `skyrl-megatron` runs with, after every check (ours, then the host's); otherwise a
    ConfigError naming each problem with its fix.

    Ours run before the host's full parse where that is heavy (`validation.validate_overrides`), so a bad
    value of ours is reported before torch loads on either host. The host's strict-parse errors (skyrl
    0.4: unknown keys, removed options) become a ConfigError too.
    """
    from skyrl_megatron.validation import validate_config, validate_overrides

    try:
        validate_overrides(overrides)
        cfg = compose_config(overrides)
    except ConfigError:
        raise
    except ValueError as err:  # the host's strict parse: unknown keys, removed options
        raise ConfigError([_parse_problem(err)]) from err
    validate_config(cfg)
    return cfg


def report_config_error(err: ConfigError) -> None:
    print(f"skyrl-megatron: {err}", file=sys.stderr)


def _validate_and_run(cfg) -> None:
    from skyrl_megatron.validation import validate_config

    try:
        validate_config(cfg)
    except ConfigError as err:
        report_config_error(err)
        sys.exit(exit_codes.CONFIG_ERROR)
    _train(cfg)


def _train(cfg) -> None:
    """Run the training; exit with `exit_codes.PREEMPTED` when it stopped on the preemption signal (its
    checkpoint written) and `exit_codes.FAILED` with the message alone when it failed for a reason it names."""
    from skyrl_megatron.failures import Preempted, ReportedFailure
    from skyrl_megatron.launch import run_experiment

    try:
        run_experiment(cfg)
    except Preempted as stopped:
        print(f"skyrl-megatron: {stopped}", file=sys.stderr)
        sys.exit(exit_codes.PREEMPTED)
    except ReportedFailure as failure:
        print(f"skyrl-megatron: training failed: {failure}", file=sys.stderr)
        sys.exit(exit_codes.FAILED)


def _run_with_hydra(host, argv: list[str]) -> None:
    import hydra

    app = hydra.main(config_path=host.hydra_config_dir(), config_name=host.hydra_config_name, version_base="1.3")
    sys.argv = [sys.argv[0], *host.hydra_overrides(argv)]
    app(_validate_and_run)()


HELP_FLAGS = ("-h", "--help")


def typed_help() -> str:
    """skyrl 0.4's typed config has no ``--help`` of its own: the usage, and the keys we add."""
    from skyrl_megatron.config import MegatronWorkerConfig

    ours = ", ".join(MegatronWorkerConfig.field_names())
    return (f"{__doc__}\nOur keys, under trainer.{{policy,ref,critic}}.megatron_config: {ours}.\n"
            "Every other key is the host's: see skyrl.train.config (SkyRLTrainConfig) of the installed skyrl.\n")


def _run_typed(argv: list[str]) -> None:
    if any(arg in HELP_FLAGS for arg in argv):
        print(typed_help())
        return
    try:
        cfg = checked_config(argv)
    except ConfigError as err:
        report_config_error(err)
        sys.exit(exit_codes.CONFIG_ERROR)
    _train(cfg)


def _parse_problem(err: ValueError):
    from skyrl_megatron.config import Problem

    return Problem("(command line)", str(err), "check the key against the host's config classes (skyrl.train.config)")


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["plan"]:  # the memory planner has its own flags; the host's parser never sees them
        from skyrl_megatron.planner.cli import main as plan

        sys.exit(plan(argv[1:]))
    host = current()
    if hasattr(host, "hydra_config_dir"):
        _run_with_hydra(host, argv)
    else:
        _run_typed(argv)


if __name__ == "__main__":
    main()
