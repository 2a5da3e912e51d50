"""Up-front validation of a composed config: ours first (`config.check_config`, every problem named
with its key and fix), then the host's own (through its adapter). Nothing heavy runs before: where the
host's full parse is heavy itself (skyrl 0.4's imports torch), ours run on its light parse of the same
overrides first (`validate_overrides`).

It sits above both: `config.py` knows nothing of the host, and the host adapters nothing of our rules.
"""

from __future__ import annotations

import re

from skyrl_megatron.config import ConfigError, Problem, check_config
from skyrl_megatron.hosts import current


def validate_config(cfg, *, run_host_checks: bool = True) -> None:
    """Raise ConfigError for a bad config (ours or the host's checks); return None for a good one."""
    host = current()
    unsupported = host.unsupported_settings(cfg)
    if unsupported:
        fix = f"remove it, or run the host's built-in Megatron backend ({host.host_main}, without skyrl-megatron)"
        raise ConfigError(
            Problem(key, f"{value!r}: a setting of {host.release.label}'s built-in Megatron backend that skyrl-megatron does not implement", fix)
            for key, value in unsupported
        )
    try:
        check_config(host.our_view(cfg))
    except ConfigError as error:
        raise ConfigError(_in_host_names(error.problems, host.host_key_names())) from None
    if run_host_checks:
        validate_host_config(cfg)


def validate_overrides(overrides: list[str]) -> None:
    """Our checks on the overrides, before the host composes its full config where that is heavy: a bad
    value of ours is then reported before torch loads, as on a host whose parse is light. The host's own
    checks need its full config (`validate_config` runs them, and ours again, on it); its strict-parse
    errors (ValueError) come out as its full parse would raise them."""
    light = current().light_config(list(overrides))
    if light is not None:
        validate_config(light, run_host_checks=False)


def validate_host_config(cfg) -> None:
    """The host's own checks; its assertions are re-raised as ConfigError so every problem reads the same."""
    host = current()
    try:
        host.validate(cfg)
    except ConfigError:
        raise  # the adapter's own checks already name key and fix
    except (AssertionError, ValueError, NotImplementedError) as err:
        fix = f"see {host.release.label}'s config docs"
        raise ConfigError([Problem("(host check)", str(err) or repr(err), fix)]) from err


def _in_host_names(problems: list[Problem], names: dict[str, str]) -> list[Problem]:
    """Our checks name keys as our view has them; the user set them under the host's names."""
    if not names:
        return problems

    def rename(text: str) -> str:
        for ours, theirs in names.items():
            text = re.sub(rf"(?<![\w.]){re.escape(ours)}(?![\w])", theirs, text)
        return text

    return [Problem(rename(p.key), rename(p.message), rename(p.fix)) for p in problems]
