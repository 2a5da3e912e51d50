"""The skyrl 0.4 leg: these tests run in the second environment (`.venv-skyrl04`, `make test`)."""

import pytest

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.skyrl_0_4 import SkyRL04


def pytest_collection_modifyitems(config, items):
    if not isinstance(current(), SkyRL04):
        raise pytest.UsageError("tests/host04 runs under skyrl 0.4 (make test sets up .venv-skyrl04 for it)")
