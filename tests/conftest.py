"""Shared fixtures. Nothing here touches a model hub: every checkpoint is built from a config."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.skyrl_0_4 import SkyRL04

# Each host's own tests run only under it: tests/host04 with skyrl 0.4 (`.venv`, which also runs the
# host-independent rest), tests/host03 with skyrl-train 0.3.1 (`.venv-skyrl-train`); `make test` runs both.
collect_ignore = ["host03"] if isinstance(current(), SkyRL04) else ["host04"]


@pytest.fixture
def hf_config_dir(tmp_path: Path):
    """Factory: a directory holding only a tiny model's config.json (enough for config validation)."""
    from skyrl_megatron.testing import tiny_config

    def make(family: str = "qwen3", **overrides) -> str:
        out = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        tiny_config(family, **overrides).to_json_file(out / "config.json")
        return str(out)

    return make


@pytest.fixture
def compose(tmp_path: Path):
    """Factory: the composed `skyrl-megatron` config with overrides, writing only under tmp_path."""
    from skyrl_megatron.cli import compose_config

    def make(*overrides: str):
        base = [f"trainer.export_path={tmp_path}/export", f"trainer.ckpt_path={tmp_path}/ckpt"]
        return compose_config(base + list(overrides))

    return make
