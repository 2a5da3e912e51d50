"""Activation: make the installed host build our workers for ``trainer.strategy=megatron``.

The host's experiment class imports its Megatron workers from a fixed module path (named by the host
adapter). :func:`activate` serves our worker module under that name (an import alias) in this
process and, through a Ray worker-process setup hook, in every Ray process started afterwards. It
also applies the adapter's fixes for host modules, the moment they are imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.base import LocalEngineFactories

logger = logging.getLogger(__name__)

STRATEGY = "megatron"
OUR_WORKER_MODULE = "skyrl_megatron.workers"
ACTIVATION_ENV_VAR = "SKYRL_MEGATRON_ACTIVE"
_USER_SETUP_HOOK_ENV_VAR = "SKYRL_MEGATRON_USER_SETUP_HOOK"


def strategy_spec() -> dict[str, str]:
    """Target of the ``skyrl_train.strategies`` entry point: where the ``megatron`` workers live."""
    return {
        "strategy": STRATEGY,
        "policy": f"{OUR_WORKER_MODULE}:PolicyWorker",
        "ref": f"{OUR_WORKER_MODULE}:RefWorker",
        "critic": f"{OUR_WORKER_MODULE}:CriticWorker",
        "activate": "skyrl_megatron:activate",
    }


class _WorkerModuleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves our worker module under the host's Megatron worker module name."""

    def __init__(self, host_module: str):
        self.host_module = host_module

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.host_module:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(OUR_WORKER_MODULE)

    def exec_module(self, module):
        pass


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a host module right after it is imported, without importing it ourselves.

    Importing host modules eagerly is not an option: activation also runs in Ray's worker set-up
    hook, where importing the host's trainer modules aborts the process.
    """

    def __init__(self, patches: dict[str, Any]):
        self.patches = patches

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


def _ray_wrapped_engines(num_engines: int, model_path: str, *, dtype: str, seed: int, device: str,
                         colocate_pg=None) -> list:
    from skyrl_megatron.engines.cpu_engine import create_ray_wrapped_cpu_engines

    return create_ray_wrapped_cpu_engines(num_engines, model_path, dtype=dtype, seed=seed, device=device,
                                          colocate_pg=colocate_pg)


def _engine_client(num_engines: int, model_path: str, *, dtype: str, seed: int, device: str,
                   return_routed_experts: bool = False):
    from skyrl_megatron.engines.client import create_engine_client

    return create_engine_client(num_engines, model_path, dtype=dtype, seed=seed, device=device,
                                return_routed_experts=return_routed_experts)


_LOCAL_ENGINES = LocalEngineFactories(ray_wrapped_engines=_ray_wrapped_engines, engine_client=_engine_client)


_ALIAS: _WorkerModuleAlias | None = None
_PATCHER: _PatchAfterImport | None = None
_ACTIVE = False


def activate() -> None:
    """Make the host choose our workers for ``trainer.strategy=megatron``. Idempotent.

    Works for the host's own experiment class and its subclasses, in the driver and inside the Ray
    task that builds the trainer (Ray processes started after this call run it too). Activation is
    light: our workers are imported only when the host imports its Megatron worker module, because
    Ray's worker set-up hook must not import the host's worker modules (Ray aborts the process).
    """
    global _ACTIVE, _ALIAS, _PATCHER
    host = current()
    host.apply_compat_fixes()
    if _ALIAS is None:
        _ALIAS = _WorkerModuleAlias(host.megatron_worker_module)
        _PATCHER = _PatchAfterImport(host.import_patches(_LOCAL_ENGINES))
    for finder in (_ALIAS, _PATCHER):
        if not any(existing is finder for existing in sys.meta_path):
            sys.meta_path.insert(0, finder)
    for name, patch in _PATCHER.patches.items():
        if name in sys.modules:  # imported before activation
            patch(sys.modules[name])
    existing = sys.modules.get(host.megatron_worker_module)
    if existing is not None and existing.__name__ != OUR_WORKER_MODULE:
        # the host's module was imported before activation: replace it
        sys.modules[host.megatron_worker_module] = importlib.import_module(OUR_WORKER_MODULE)
    os.environ[ACTIVATION_ENV_VAR] = "1"
    if not _ACTIVE:
        _wrap_ray_init()
        logger.info(
            "skyrl-megatron: trainer.strategy=megatron runs skyrl-megatron's workers on %s "
            "(the host's built-in Megatron backend: run `%s` without activating skyrl-megatron)",
            host.release.label, host.host_main,
        )
    _ACTIVE = True


def is_active() -> bool:
    return _ACTIVE


def ray_worker_setup_hook() -> None:
    """Runs in each Ray worker process before any task: activate, then chain a user's own hook."""
    activate()
    user_hook = os.environ.get(_USER_SETUP_HOOK_ENV_VAR)
    if user_hook:
        module_name, _, attr = user_hook.rpartition(".")
        getattr(importlib.import_module(module_name), attr)()


_HOOK_PATH = f"{__name__}.ray_worker_setup_hook"


def _wrap_ray_init() -> None:
    import ray

    if getattr(ray.init, "_skyrl_megatron_wrapped", False):
        return
    original_init = ray.init

    def init(*args: Any, **kwargs: Any):
        runtime_env = dict(kwargs.get("runtime_env") or {})
        env_vars = dict(runtime_env.get("env_vars") or {})
        user_hook = runtime_env.get("worker_process_setup_hook")
        if isinstance(user_hook, str) and user_hook != _HOOK_PATH:
            env_vars[_USER_SETUP_HOOK_ENV_VAR] = user_hook
        elif user_hook is not None and user_hook != _HOOK_PATH:
            raise ValueError(
                "skyrl_megatron.activate() chains Ray's worker_process_setup_hook only when it is given "
                "as an import path string (e.g. 'my_pkg.setup'); pass it that way"
            )
        env_vars[ACTIVATION_ENV_VAR] = "1"
        runtime_env["env_vars"] = env_vars
        runtime_env["worker_process_setup_hook"] = _HOOK_PATH
        kwargs["runtime_env"] = runtime_env
        return original_init(*args, **kwargs)

    init._skyrl_megatron_wrapped = True  # type: ignore[attr-defined]
    init.__wrapped__ = original_init  # type: ignore[attr-defined]
    init.__doc__ = original_init.__doc__
    ray.init = init
