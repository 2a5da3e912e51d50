"""The skyrl-train 0.3.1 leg: these tests run in the second environment (`.venv-skyrl-train`, `make test`)."""

import pytest

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.skyrl_train_0_3 import SkyRLTrain03


def pytest_collection_modifyitems(config, items):
    if not isinstance(current(), SkyRLTrain03):
        raise pytest.UsageError("tests/host03 runs under skyrl-train 0.3.1 (make test sets up .venv-skyrl-train for it)")
