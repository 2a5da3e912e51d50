"""Up-front validation of a composed config: ours first (`config.check_config`, every problem named
with its key and fix), then the host's own (through its adapter). Nothing heavy runs before.

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
