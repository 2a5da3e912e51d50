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

from skyrl_megatron.host_api import standalone_process_group

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


# The module whose `create_ray_wrapped_inference_engines_from_config` BasePPOExp._setup_trainer calls.
_ENTRYPOINT_MODULE = "skyrl_train.entrypoints.main_base"


def _route_local_engines(main_base) -> None:
    """Let ``generator.engine=cpu`` put our CPU engine where the host would start vLLM/SGLang.

    The host looks the factory up as a module global at call time, so every BasePPOExp (the host's
    and users' subclasses) picks the engine from the config.
    """
    original = main_base.create_ray_wrapped_inference_engines_from_config
    if getattr(original, "_skyrl_megatron_routed", False):
        return

    def create_ray_wrapped_inference_engines_from_config(cfg, colocate_pg, tokenizer):
        if cfg.generator.get("engine", "auto") != "cpu":
            return original(cfg, colocate_pg, tokenizer)
        from skyrl_megatron.engines import create_ray_wrapped_cpu_engines

        return create_ray_wrapped_cpu_engines(
            cfg.generator.num_inference_engines,
            cfg.trainer.policy.model.path,
            dtype=cfg.generator.model_dtype,
            seed=cfg.trainer.seed,
        )

    create_ray_wrapped_inference_engines_from_config._skyrl_megatron_routed = True  # type: ignore[attr-defined]
    create_ray_wrapped_inference_engines_from_config.__wrapped__ = original  # type: ignore[attr-defined]
    main_base.create_ray_wrapped_inference_engines_from_config = create_ray_wrapped_inference_engines_from_config


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
    if not any(finder is _PATCHER for finder in sys.meta_path):
        sys.meta_path.insert(0, _PATCHER)
    if _ENTRYPOINT_MODULE in sys.modules:  # imported before activation
        _route_local_engines(sys.modules[_ENTRYPOINT_MODULE])
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
    _fix_custom_process_group()
    _fix_fsdp2_wrap_classes(fsdp_utils)
    if _TOKENIZER_MODULE in sys.modules:
        _legacy_chat_template_for_host(sys.modules[_TOKENIZER_MODULE])
    _COMPAT_DONE = True


_TOKENIZER_MODULE = "transformers.tokenization_utils_base"
_HOST_PACKAGES = ("skyrl_train.", "skyrl_gym.")


def _legacy_chat_template_for_host(tokenization_utils_base) -> None:
    """Give host code transformers 4's ``apply_chat_template(tokenize=True)``: a list of token ids.

    transformers 5 (which Megatron-Bridge needs) returns a BatchEncoding there by default. The host's
    generator then concatenates it with lists and fails, and its dataset's prompt-length filter takes
    ``len()`` of the mapping (2) and keeps every prompt. Only calls made from the host's packages that
    do not ask for ``return_dict`` themselves get the old default; everyone else keeps transformers 5's.
    """
    cls = tokenization_utils_base.PreTrainedTokenizerBase
    original = cls.apply_chat_template
    if getattr(original, "_skyrl_megatron_legacy", False):
        return

    def apply_chat_template(self, conversation, *args, **kwargs):
        if "return_dict" not in kwargs and kwargs.get("tokenize", True):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_HOST_PACKAGES):
                kwargs["return_dict"] = False
        return original(self, conversation, *args, **kwargs)

    apply_chat_template._skyrl_megatron_legacy = True  # type: ignore[attr-defined]
    apply_chat_template.__wrapped__ = original  # type: ignore[attr-defined]
    apply_chat_template.__doc__ = original.__doc__
    cls.apply_chat_template = apply_chat_template


_FSDP_STRATEGY_MODULE = "skyrl_train.distributed.fsdp_strategy"


def _fix_fsdp2_wrap_classes(fsdp_utils) -> None:
    """0.3.1's ``apply_fsdp2`` indexes the model's ``_no_split_modules`` (``[0]``).

    transformers 5 makes that attribute a *set* on every model instance, so the host's own FSDP2
    strategy fails in ``init_model`` with "'set' object is not subscriptable" as soon as our
    dependency set is installed. The wrapper hands the host a sorted list; it wraps the same
    decoder-layer classes as before.
    """
    original = fsdp_utils.apply_fsdp2
    if getattr(original, "_skyrl_megatron_fixed", False):
        return

    def apply_fsdp2(model, fsdp_kwargs, config):
        if isinstance(getattr(model, "_no_split_modules", None), (set, frozenset)):
            model._no_split_modules = sorted(model._no_split_modules)
        return original(model, fsdp_kwargs, config)

    apply_fsdp2._skyrl_megatron_fixed = True  # type: ignore[attr-defined]
    apply_fsdp2.__wrapped__ = original  # type: ignore[attr-defined]
    fsdp_utils.apply_fsdp2 = apply_fsdp2
    if _FSDP_STRATEGY_MODULE in sys.modules:  # imported the function by name before we got here
        _rebind_fsdp2_wrap(sys.modules[_FSDP_STRATEGY_MODULE])


def _rebind_fsdp2_wrap(fsdp_strategy) -> None:
    fsdp_strategy.apply_fsdp2 = importlib.import_module("skyrl_train.distributed.fsdp_utils").apply_fsdp2


# Host modules patched the moment they are imported (in every process that activated).
_PATCHER = _PatchAfterImport(
    {
        _ENTRYPOINT_MODULE: _route_local_engines,
        _TOKENIZER_MODULE: _legacy_chat_template_for_host,
        _FSDP_STRATEGY_MODULE: _rebind_fsdp2_wrap,
    }
)


def _fix_custom_process_group() -> None:
    """0.3.1's ``init_custom_process_group`` picks torch's keyword by comparing version *strings*.

    ``"2.11.0" >= "2.6"`` is false, so on torch >= 2.10 it passes the removed ``pg_options`` and every
    broadcast weight sync fails. The replacement creates the same stand-alone group (outside the
    default world, ranks mapped one to one) with today's keyword.
    """
    distributed_utils = importlib.import_module("skyrl_train.distributed.utils")
    if getattr(distributed_utils.init_custom_process_group, "_skyrl_megatron_fixed", False):
        return
    distributed_utils.init_custom_process_group = standalone_process_group
    strategy = sys.modules.get("skyrl_train.weight_sync.broadcast_strategy")
    if strategy is not None:  # imported the broken function by name before we got here
        strategy.init_custom_process_group = standalone_process_group


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
    limitations of the host's built-in Megatron path, not of ours. Its batch-size rules size a critic's
    DP as its FSDP critic's; a Megatron critic's DP size is put in their place (our rules check the
    rest of the critic, `config.check_critic`). Host assertions are re-raised as `ConfigError` so every
    config problem reads the same way.
    """
    from skyrl_train.utils import utils as host_utils

    from skyrl_megatron.config import ConfigError, Problem

    original = host_utils.validate_megatron_cfg
    host_utils.validate_megatron_cfg = lambda cfg: None
    critic_sp = _present_megatron_critic_dp(cfg)
    try:
        host_utils.validate_cfg(cfg)
    except (AssertionError, ValueError, NotImplementedError) as err:
        raise ConfigError([Problem("(host check)", str(err) or repr(err), "see skyrl-train's config docs")]) from err
    finally:
        host_utils.validate_megatron_cfg = original
        if critic_sp is not None:
            cfg.trainer.critic.sequence_parallel_size = critic_sp


def _present_megatron_critic_dp(cfg):
    """The host checks the critic's mini-batch against world / `critic.sequence_parallel_size` (its
    FSDP critic's DP size); a Megatron critic's DP size is world / (TP*PP*CP). For the duration of
    the host's checks the divisor is ours; returns the value to restore (None: nothing changed)."""
    from skyrl_megatron.config import megatron_dp_divisor

    if cfg.trainer.strategy != STRATEGY or not cfg.trainer.critic.model.get("path"):
        return None
    original = cfg.trainer.critic.sequence_parallel_size
    cfg.trainer.critic.sequence_parallel_size = megatron_dp_divisor(cfg, "critic")
    return original


def initialize_ray(cfg, log_to_driver: bool = True) -> None:
    """The host's Ray start (its runtime environment, its registries), plus what a CPU run needs.

    On the CPU runtime Ray is told of as many *logical* GPUs as the workers will ask for: the host's
    actor groups and placement groups request GPUs, and Ray schedules them only where it believes
    GPUs exist. Every Ray process is put on our CPU runtime.
    """
    import ray
    from skyrl_train.utils.ppo_utils import sync_registries
    from skyrl_train.utils.utils import prepare_runtime_environment

    from skyrl_megatron.failures import start_registry
    from skyrl_megatron.runtime import RUNTIME_ENV_VAR

    activate()
    resources: dict[str, int] = {}
    if runs_on_cpu(cfg):
        # The host probes GPU peer access (through Ray, on a GPU-less driver) to tune NCCL; with one
        # GPU per node it skips the probe. NCCL settings mean nothing to gloo.
        env_vars = prepare_runtime_environment(_single_gpu_per_node(cfg))
        env_vars[RUNTIME_ENV_VAR] = "cpu"
        resources = cpu_cluster_resources(cfg)
    else:
        env_vars = prepare_runtime_environment(cfg)
    # The host pins TE's attention backend for its own Megatron path (NVTE_FUSED_ATTN=0 with
    # flash_attn); Megatron-Core then refuses its default attention_backend=auto. Ours is chosen by
    # the layer spec, and users choose TE's through transformer_config_kwargs.attention_backend.
    for name in [name for name in env_vars if name.startswith("NVTE_")]:
        del env_vars[name]
    ray.init(runtime_env={"env_vars": env_vars}, log_to_driver=log_to_driver, **resources)
    sync_registries()
    start_registry()


def _single_gpu_per_node(cfg):
    from omegaconf import OmegaConf, open_dict

    view = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(view):
        view.generator.inference_engine_tensor_parallel_size = 1
        for role in ("policy", "critic", "ref"):
            view.trainer.placement[f"{role}_num_gpus_per_node"] = 1
    return view


def runs_on_cpu(cfg) -> bool:
    from skyrl_megatron.runtime import Device, resolve_device

    megatron = cfg.trainer.policy.get("megatron_config") or {}
    return cfg.trainer.strategy == STRATEGY and resolve_device(megatron.get("runtime")) is Device.CPU


def cpu_cluster_resources(cfg) -> dict[str, int]:
    """Logical GPUs for every worker actor; CPUs for those, the CPU engines and the trainer task."""
    from skyrl_megatron.config import active_roles, role_world_size

    gpus = sum(role_world_size(cfg, role) for role in active_roles(cfg))
    engines = cfg.generator.num_inference_engines if cfg.generator.get("engine", "auto") == "cpu" else 0
    return {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + engines + 1)}


def base_experiment_class():
    from skyrl_train.entrypoints.main_base import BasePPOExp

    return BasePPOExp


def run_experiment(cfg, experiment_cls=None, *, in_driver: bool = False, log_to_driver: bool = True) -> None:
    """Driver side: start Ray and run the host trainer.

    By default the trainer runs in a Ray task, as the host's own main does (the driver may sit on a
    small head node). `in_driver` runs it in this process instead, so its progress bar and prints
    reach the terminal directly. A worker process that dies is reported as a
    :class:`~skyrl_megatron.failures.WorkerFailure` naming its role, rank and mesh coordinates.
    """
    import ray

    initialize_ray(cfg, log_to_driver=log_to_driver)
    if in_driver:
        _run_experiment_in_task(cfg, experiment_cls)
    else:
        ray.get(_experiment_task.remote(cfg, experiment_cls))


def _run_experiment_in_task(cfg, experiment_cls=None) -> None:
    from skyrl_megatron.failures import explain

    activate()
    experiment_cls = experiment_cls or base_experiment_class()
    try:
        experiment_cls(cfg).run()
    except Exception as error:
        failure = explain(error)
        if failure is None:
            raise
        raise failure from error


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
