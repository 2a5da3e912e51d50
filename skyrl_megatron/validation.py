"""Up-front validation of a composed config: ours first (`config.check_config`, every problem named
with its key and fix), then the host's own (`host.validate_host_config`). Nothing heavy runs before.

It sits above both: `config.py` knows nothing of the host, and `host.py` nothing of our rules.
"""

from __future__ import annotations

from skyrl_megatron import host
from skyrl_megatron.config import check_config


def validate_config(cfg, *, run_host_checks: bool = True) -> None:
    """Raise ConfigError (ours) or the host's error for a bad config; return None for a good one."""
    check_config(cfg)
    if run_host_checks:
        host.validate_host_config(cfg)
