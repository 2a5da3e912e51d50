"""The one door to the host framework (skyrl-train).

Everything that depends on skyrl-train's internals lives here, so a new host release means
changing this file only:

* worker selection: the host's ``BasePPOExp._setup_trainer`` imports Megatron workers from the fixed
  module path ``skyrl_train.workers.megatron.megatron_worker``. :func:`activate` points that path at
  our workers (an import alias), in this process and, through a Ray worker-process setup hook, in
  every Ray process started afterwards;
* validation: the host's ``validate_cfg`` with its Megatron section replaced by ours;
* the host's config directory, Ray start-up and entrypoint;
* what workers use from the host: worker bases, MeshRank, batch types, the policy-loss registry and
  KL estimator (see "Worker-side host API" below);
* compatibility fixes for the pinned release (see :func:`_apply_compat_fixes`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STRATEGY = "megatron"
HOST_PACKAGE = "skyrl-train"
SUPPORTED_HOST_VERSIONS = ("0.3.1",)
HOST_STRATEGIES = ("fsdp", "fsdp2", "deepspeed", STRATEGY)

# The module the host imports its Megatron workers from (entrypoints/main_base.py).
HOST_MEGATRON_WORKER_MODULE = "skyrl_train.workers.megatron.megatron_worker"
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


def host_version() -> str:
    return importlib.metadata.version(HOST_PACKAGE)


def host_config_dir() -> Path:
    import skyrl_train

    return Path(skyrl_train.__file__).parent / "config"


# ----------------------------------------------------------------------------------------------
# Activation
# ----------------------------------------------------------------------------------------------


class _WorkerModuleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves our worker module under the host's Megatron worker module name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == HOST_MEGATRON_WORKER_MODULE:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(OUR_WORKER_MODULE)

    def exec_module(self, module):
        pass


_ALIAS = _WorkerModuleAlias()
_ACTIVE = False


def activate() -> None:
    """Make the host choose our workers for ``trainer.strategy=megatron``. Idempotent.

    Works for the host's own ``BasePPOExp`` and its subclasses, in the driver and inside the Ray
    task that builds the trainer (Ray processes started after this call run it too). Activation is
    light: our workers are imported only when the host imports its Megatron worker module, because
    Ray's worker set-up hook must not import the host's worker modules (Ray aborts the process).
    """
    global _ACTIVE
    _apply_compat_fixes()
    if not any(finder is _ALIAS for finder in sys.meta_path):
        sys.meta_path.insert(0, _ALIAS)
    existing = sys.modules.get(HOST_MEGATRON_WORKER_MODULE)
    if existing is not None and existing.__name__ != OUR_WORKER_MODULE:
        # the host's module was imported before activation: replace it
        sys.modules[HOST_MEGATRON_WORKER_MODULE] = importlib.import_module(OUR_WORKER_MODULE)
    os.environ[ACTIVATION_ENV_VAR] = "1"
    if not _ACTIVE:
        _wrap_ray_init()
        _check_host_version()
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


_HOOK_PATH = f"{__name__}.ray_worker_setup_hook"


def _check_host_version() -> None:
    try:
        version = host_version()
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"skyrl-megatron needs the host framework: pip install {HOST_PACKAGE}=={SUPPORTED_HOST_VERSIONS[-1]}")
    if version not in SUPPORTED_HOST_VERSIONS:
        logger.warning(
            "skyrl-megatron was built against %s %s, found %s; host touch points live in skyrl_megatron/host.py",
            HOST_PACKAGE,
            "/".join(SUPPORTED_HOST_VERSIONS),
            version,
        )


_COMPAT_DONE = False


def _apply_compat_fixes() -> None:
    """Fixes for skyrl-train 0.3.1 that its own imports need on our dependency set."""
    global _COMPAT_DONE
    if _COMPAT_DONE:
        return
    # 0.3.1 imports MixedPrecisionPolicy from fsdp_utils, which never defines it (fixed upstream later).
    fsdp_utils = importlib.import_module("skyrl_train.distributed.fsdp_utils")
    if not hasattr(fsdp_utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_utils.MixedPrecisionPolicy = MixedPrecisionPolicy
    _allow_flash_attn_import_without_kernels()
    _COMPAT_DONE = True


def _allow_flash_attn_import_without_kernels() -> None:
    """The host imports `flash_attn` (for its pure-torch padding helpers) at module level.

    Where flash-attn was installed without its compiled CUDA extension (CPU boxes, our GPU machines),
    `import flash_attn` fails on `flash_attn_2_cuda`. We register a placeholder for that extension only:
    the pure-torch helpers import, and any call into a real kernel fails with a clear message.
    """
    if "flash_attn_2_cuda" in sys.modules or importlib.util.find_spec("flash_attn_2_cuda") is not None:
        return
    placeholder = types.ModuleType("flash_attn_2_cuda")

    def _kernel_stub(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(
                f"flash_attn_2_cuda.{name}: flash-attn's CUDA kernels are not built in this environment; "
                "skyrl-megatron does not use them (its attention comes from the Megatron layer spec)"
            )

        return kernel

    placeholder.__getattr__ = _kernel_stub  # type: ignore[method-assign]
    placeholder.__doc__ = "placeholder registered by skyrl_megatron.host: the compiled extension is absent"
    sys.modules["flash_attn_2_cuda"] = placeholder


# ----------------------------------------------------------------------------------------------
# Validation, Ray, entrypoint
# ----------------------------------------------------------------------------------------------


def validate_host_config(cfg) -> None:
    """Run the host's own checks, with its Megatron section swapped for ours.

    The host's `validate_megatron_cfg` forbids a critic and requires vLLM + NCCL weight sync; those are
    limitations of the host's built-in Megatron path, not of ours. Host assertions are re-raised as
    `ConfigError` so every config problem reads the same way.
    """
    from skyrl_train.utils import utils as host_utils

    from skyrl_megatron.config import ConfigError, Problem

    original = host_utils.validate_megatron_cfg
    host_utils.validate_megatron_cfg = lambda cfg: None
    try:
        host_utils.validate_cfg(cfg)
    except (AssertionError, ValueError, NotImplementedError) as err:
        raise ConfigError([Problem("(host check)", str(err) or repr(err), "see skyrl-train's config docs")]) from err
    finally:
        host_utils.validate_megatron_cfg = original


def initialize_ray(cfg) -> None:
    from skyrl_train.utils.utils import initialize_ray as host_initialize_ray

    activate()
    host_initialize_ray(cfg)


def base_experiment_class():
    from skyrl_train.entrypoints.main_base import BasePPOExp

    return BasePPOExp


def run_experiment(cfg, experiment_cls=None) -> None:
    """Driver side: start Ray and run the host trainer in a Ray task (as the host's own main does)."""
    import ray

    initialize_ray(cfg)
    ray.get(_experiment_task.remote(cfg, experiment_cls))


def _run_experiment_in_task(cfg, experiment_cls=None) -> None:
    activate()
    experiment_cls = experiment_cls or base_experiment_class()
    experiment_cls(cfg).run()


def _make_task():
    import ray

    return ray.remote(num_cpus=1)(_run_experiment_in_task)


class _LazyTask:
    """Creates the Ray remote function on first use, so importing this module never imports Ray."""

    _task = None

    def remote(self, *args, **kwargs):
        if self._task is None:
            self._task = _make_task()
        return self._task.remote(*args, **kwargs)


_experiment_task = _LazyTask()


def worker_classes(strategy: str):
    """(policy, critic, ref) classes the host would build for `strategy` (used by tests and the CLI)."""
    if strategy == STRATEGY:
        module = importlib.import_module(HOST_MEGATRON_WORKER_MODULE)
    elif strategy in ("fsdp", "fsdp2"):
        module = importlib.import_module("skyrl_train.workers.fsdp.fsdp_worker")
    elif strategy == "deepspeed":
        module = importlib.import_module("skyrl_train.workers.deepspeed.deepspeed_worker")
    else:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(HOST_STRATEGIES)}")
    return module.PolicyWorker, module.CriticWorker, module.RefWorker


# ----------------------------------------------------------------------------------------------
# Worker-side host API: everything our workers take from skyrl-train
# ----------------------------------------------------------------------------------------------


def worker_bases():
    """(PolicyWorkerBase, RefWorkerBase, CriticWorkerBase): the host's worker contract."""
    from skyrl_train.workers.worker import CriticWorkerBase, PolicyWorkerBase, RefWorkerBase

    return PolicyWorkerBase, RefWorkerBase, CriticWorkerBase


def make_mesh_rank(*, dp: int, cp: int, tp: int, pp: int, world_size: int, dp_size: int, pp_size: int):
    """The host's MeshRank; the host collects from ``sp == 0``, so a Megatron rank puts its CP rank there."""
    from skyrl_train.distributed.dispatch import MeshRank

    return MeshRank(dp=dp, sp=cp, tp=tp, pp=pp, world_size=world_size, dp_size=dp_size, pp_size=pp_size)


def training_output(tensors: dict | None = None, metadata: dict | None = None):
    from skyrl_train.training_batch import TrainingOutputBatch

    out = TrainingOutputBatch(tensors or {})
    out.metadata = metadata or {}
    return out


def policy_loss_function(name: str):
    """The host's registered policy loss `name` (regular, dual_clip, gspo, cispo, ... or a user's)."""
    from skyrl_train.utils.ppo_utils import PolicyLossRegistry

    return PolicyLossRegistry.get(name)


def masked_mean(tensor, mask, dim=None):
    from skyrl_train.utils.ppo_utils import masked_mean as host_masked_mean

    return host_masked_mean(tensor, mask, dim=dim)


def approx_kl(log_probs, base_log_probs, loss_mask, estimator: str):
    """The host's KL estimator *with* gradients.

    Host 0.3.1 wraps `compute_approx_kl` in ``torch.no_grad()``, so its KL loss trains nothing. We
    call the undecorated function (kept by functools.wraps as ``__wrapped__``) so the KL term
    actually regularises the policy.
    """
    from skyrl_train.utils.ppo_utils import compute_approx_kl

    fn = getattr(compute_approx_kl, "__wrapped__", compute_approx_kl)
    return fn(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=estimator)


def weight_chunk(bucket):
    """The host's ``WeightChunk`` for a :class:`skyrl_megatron.weights.WeightBucket` (the same four fields)."""
    from skyrl_train.weight_sync import WeightChunk

    return WeightChunk(names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes, tensors=bucket.tensors)


def inference_engine_interface():
    """The host's ``InferenceEngineInterface``: what its InferenceEngineClient and generators drive."""
    from skyrl_train.inference_engines.base import InferenceEngineInterface

    return InferenceEngineInterface


def weight_update_request_base():
    """The host's ``WeightUpdateRequest`` (names, dtypes, shapes), base of every weight-sync request."""
    from skyrl_train.weight_sync.base import WeightUpdateRequest

    return WeightUpdateRequest


def lora_load_request_class():
    """The host's ``LoraLoadRequest`` (load adapters from disk instead of receiving tensors)."""
    from skyrl_train.weight_sync.base import LoraLoadRequest

    return LoraLoadRequest


def ray_wrapped_inference_engine(actor):
    """The host's ``RayWrappedInferenceEngine`` around an engine actor handle (how the host holds engines)."""
    from skyrl_train.inference_engines.ray_wrapped_inference_engine import RayWrappedInferenceEngine

    return RayWrappedInferenceEngine(actor)
