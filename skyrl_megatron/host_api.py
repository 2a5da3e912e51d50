"""What our workers, losses and engines take from the host: the installed host's adapter, by name.

``host_api.worker_bases()``, ``host_api.masked_mean(...)`` and the rest are the methods of
:class:`skyrl_megatron.hosts.base.HostAdapter` (see there for each), called on the adapter that
:func:`skyrl_megatron.hosts.current` picked for the installed host. Importing this module imports
no host code.
"""

from __future__ import annotations

from skyrl_megatron.hosts import current


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(current(), name)
