"""Choosing the host adapter from what is installed; an unsupported host fails naming what we support."""

from __future__ import annotations

import pytest

from skyrl_megatron import hosts
from skyrl_megatron.hosts.skyrl_0_4 import SkyRL04
from skyrl_megatron.hosts.skyrl_train_0_3 import SkyRLTrain03


@pytest.fixture
def installed(monkeypatch):
    """Pretend these distributions (name -> version) are what is installed."""
    monkeypatch.delenv(hosts.HOST_ENV_VAR, raising=False)

    def install(**versions):
        table = {name.replace("_", "-"): version for name, version in versions.items()}
        monkeypatch.setattr(hosts, "_installed", table.get)

    return install


def test_each_supported_release_gets_its_adapter(installed):
    installed(skyrl_train="0.3.1")
    assert hosts.detect() is SkyRLTrain03
    installed(skyrl="0.4.0")
    assert hosts.detect() is SkyRL04
    installed(skyrl="0.4.7")
    assert hosts.detect() is SkyRL04


def test_with_both_installed_the_newest_wins_unless_the_env_var_chooses(installed, monkeypatch):
    installed(skyrl="0.4.0", skyrl_train="0.3.1")
    assert hosts.detect() is SkyRL04
    monkeypatch.setenv(hosts.HOST_ENV_VAR, "skyrl-train")
    assert hosts.detect() is SkyRLTrain03


@pytest.mark.parametrize(
    "versions, found",
    [({"skyrl_train": "0.2.0"}, "found skyrl-train 0.2.0"), ({"skyrl": "0.5.1"}, "found skyrl 0.5.1"), ({}, "found no SkyRL host")],
)
def test_an_unsupported_or_missing_host_names_the_supported_releases(installed, versions, found):
    installed(**versions)
    with pytest.raises(hosts.UnsupportedHost) as err:
        hosts.detect()
    message = str(err.value)
    assert found in message
    assert 'skyrl 0.4.x (pip install "skyrl[skyrl-train]>=0.4,<0.5")' in message
    assert 'skyrl-train 0.3.1 (pip install "skyrl-train==0.3.1")' in message


def test_an_unknown_host_in_the_env_var_is_named(installed, monkeypatch):
    installed(skyrl_train="0.3.1")
    monkeypatch.setenv(hosts.HOST_ENV_VAR, "skyrl-trainer")
    with pytest.raises(hosts.UnsupportedHost, match="SKYRL_MEGATRON_HOST='skyrl-trainer' names no host we support"):
        hosts.detect()


def test_every_adapter_implements_the_whole_interface():
    for adapter in (SkyRL04, SkyRLTrain03):
        assert not adapter.__abstractmethods__, adapter
        assert adapter.megatron_worker_module.endswith(".workers.megatron.megatron_worker")
