"""The host releases we plug into, one adapter each behind :class:`~skyrl_megatron.hosts.base.HostAdapter`.

:func:`current` picks the adapter from what is installed (``SKYRL_MEGATRON_HOST`` chooses when both
hosts are). An unsupported or missing host fails here, at start, naming the releases we support.
"""

from __future__ import annotations

import importlib.metadata
import os

from skyrl_megatron.hosts import skyrl_0_4, skyrl_train_0_3
from skyrl_megatron.hosts.base import HostAdapter, HostFeatureMissing, HostRelease

HOST_ENV_VAR = "SKYRL_MEGATRON_HOST"

# Newest first: the default when both are installed. Adapter modules import their host lazily.
_ADAPTERS: tuple[type[HostAdapter], ...] = (skyrl_0_4.SkyRL04, skyrl_train_0_3.SkyRLTrain03)
SUPPORTED = tuple(adapter.release for adapter in _ADAPTERS)


class UnsupportedHost(ImportError):
    """No supported host release is installed (or the one asked for is not)."""


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _supported_list() -> str:
    return "; ".join(f"{release.label} ({release.install})" for release in SUPPORTED)


def detect() -> type[HostAdapter]:
    """The adapter class for the installed host; raises UnsupportedHost otherwise."""
    wanted = os.environ.get(HOST_ENV_VAR)
    found = []
    for adapter in _ADAPTERS:
        release = adapter.release
        version = _installed(release.distribution)
        if version is None:
            continue
        if wanted and wanted != release.distribution:
            continue
        if release.matches(version):
            return adapter
        found.append(f"{release.distribution} {version}")
    if wanted and wanted not in {release.distribution for release in SUPPORTED}:
        raise UnsupportedHost(f"{HOST_ENV_VAR}={wanted!r} names no host we support; set it to "
                              f"{' or '.join(repr(r.distribution) for r in SUPPORTED)}, or unset it")
    installed = ", ".join(found) if found else "no SkyRL host"
    raise UnsupportedHost(
        f"skyrl-megatron found {installed}"
        + (f" (with {HOST_ENV_VAR}={wanted})" if wanted else "")
        + f"; it supports {_supported_list()}"
    )


_CURRENT: HostAdapter | None = None


def current() -> HostAdapter:
    """The adapter for the installed host (created once per process)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = detect()()
    return _CURRENT


__all__ = ["HostAdapter", "HostFeatureMissing", "HostRelease", "SUPPORTED", "UnsupportedHost", "current", "detect"]
