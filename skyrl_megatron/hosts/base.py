"""The one interface between skyrl-megatron and a host release (skyrl-train 0.3.1, skyrl 0.4.x).

Each host release gets one :class:`HostAdapter` subclass in this package. Everything that names a
host module, a host class or a host config key lives in that subclass; the rest of the package asks
:func:`skyrl_megatron.hosts.current` for the adapter and never imports the host itself.

Adapters import the host lazily (inside methods): choosing an adapter, and activation inside Ray's
worker set-up hook, must not import the host's trainer modules.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class HostRelease:
    """A host release line we support: the distribution, the version prefix, a user-facing label."""

    distribution: str
    version_prefix: str
    label: str
    install: str

    def matches(self, version: str) -> bool:
        return version == self.version_prefix or version.startswith(self.version_prefix + ".")


@dataclass(frozen=True)
class LocalEngineFactories:
    """Our HF generation engines in each host's form; each takes ``(num_engines, model_path, *, dtype, seed,
    device)``, `device` "cpu" or "cuda" (a GPU of its own per engine)."""

    ray_wrapped_engines: Callable[..., list]  # engine actors as skyrl-train 0.3.1 holds them
    engine_client: Callable[..., Any]  # one inference client over engine actors, as skyrl 0.4 holds it


class HostFeatureMissing(NotImplementedError):
    """A touch point this host adapter does not provide yet: names the feature and the host that has it."""

    def __init__(self, adapter: "HostAdapter", feature: str, alternative: str):
        super().__init__(f"{feature} is not available on {adapter.release.label} yet; {alternative}")


class HostAdapter(ABC):
    """What skyrl-megatron takes from one host release.

    Three groups of touch points:

    * activation: which module the host imports its Megatron workers from, which host modules need
      a fix the moment they are imported, and fixes applied once per process;
    * the driver side: the host's config validation, Ray environment, registries, experiment class;
    * the worker side: worker bases, MeshRank, batch and output types, losses, weight-sync types.
    """

    release: HostRelease
    #: the module the host's entrypoint imports ``PolicyWorker``/``RefWorker``/``CriticWorker`` from
    megatron_worker_module: str
    #: the module holding the host's experiment class (``BasePPOExp``) and its engine factory
    entrypoint_module: str
    #: the host's own command line, for the log line that says how to get its built-in backend back
    host_main: str
    strategies: tuple[str, ...]
    #: the module holding the host's own workers for each of its other strategies
    strategy_worker_modules: dict[str, str]
    #: the host's own HF model wrapper (its FSDP workers' logprob path) and the torch helpers it calls:
    #: the reference our parity tests score against, whichever host is installed
    hf_model_wrapper_module: str
    torch_utils_module: str
    #: True where the host pre-scales advantages so that a policy loss is a plain sum over the
    #: mini-batch's tokens (0.4); False where each loss call reduces over what it gets (0.3.1)
    policy_losses_are_presummed: bool = False

    # -- activation ------------------------------------------------------------------------------

    def apply_compat_fixes(self) -> None:
        """Fixes for the host's own imports on our dependency set (once per process). Default: none."""

    def import_patches(self, engines: LocalEngineFactories) -> dict[str, Callable[[Any], None]]:
        """Host modules to patch right after they are imported, in every activated process.

        `engines` creates our HF engines where the config asks for them (``generator.engine=cpu``),
        in the form this host holds engines; it is passed in because the engines sit above the
        host adapters.
        """
        return {}

    # -- config -----------------------------------------------------------------------------------

    @abstractmethod
    def compose_config(self, overrides: list[str]):
        """The host's config with our keys, from ``key=value`` overrides (no side effects)."""

    def light_config(self, overrides: list[str]):
        """The config from the same overrides, parsed without the host's heavy steps, for our checks to run
        on before :meth:`compose_config`; None where that is light already (our checks then read its result)."""
        return None

    def unsupported_settings(self, cfg) -> list[tuple[str, Any]]:
        """(key, value) of host settings for its own Megatron backend that ours does not implement."""
        return []

    def our_view(self, cfg):
        """`cfg` in the shape our checks and workers read (skyrl-train 0.3.1's composed OmegaConf)."""
        return cfg

    def worker_view(self, worker_cfg):
        """What a worker was given (`self.cfg`) in the shape our workers read (the 0.3.1 composed config)."""
        return worker_cfg

    def algorithm_config(self, worker_cfg):
        """The host's algorithm config object, as its own loss functions expect it."""
        return worker_cfg.trainer.algorithm

    def small_prompt_file_overrides(self) -> list[str]:
        """Overrides for a run whose prompts are a small file (the demo's, the benches'): its data loader without
        worker processes where the host has a key for them. Default: none (skyrl-train 0.3.1 has no key; its
        forked loader workers are cheap, and `apply_compat_fixes` caps them at the machine's cores)."""
        return []

    def engine_sampling_overrides(self, settings: dict[str, bool | int | float | str]) -> list[str]:
        """Overrides that hand the engines sampling settings the host's config has no key for (`ignore_eos`,
        `seed`). Default, skyrl-train 0.3.1's way: it passes every key of `generator.sampling_params` on, so the
        settings are added there ("++")."""
        return [f"++generator.sampling_params.{name}={yaml_scalar(value)}" for name, value in settings.items()]

    def vllm_engine_overrides(self) -> list[str]:
        """This host's settings for its vLLM engines as the demo and the benches run them. Default, skyrl-train
        0.3.1's: the synchronous engine with its core in the engine actor's process, where a ``collective_rpc``
        can read the engine's weights back after a sync."""
        return ["generator.async_engine=false", "generator.vllm_v1_disable_multiproc=true"]

    def vllm_worker_extension_class(self) -> type:
        """The host's vLLM worker extension, for ours to extend (`engines.vllm_extension`). skyrl-train 0.3.1's
        engines take callables through ``collective_rpc`` and need none."""
        raise NotImplementedError(f"{self.release.label}: its vLLM engines take callables, no worker extension")

    def host_key_names(self) -> dict[str, str]:
        """Keys of our view of a config (skyrl-train 0.3.1's names) that this host spells otherwise, so
        a problem names the key a user of this host sets. Default: the same names."""
        return {}

    # -- driver side ------------------------------------------------------------------------------

    @abstractmethod
    def validate(self, cfg) -> None:
        """The host's own config checks, minus the ones that only hold for its built-in Megatron path."""

    @abstractmethod
    def ray_env_vars(self, cfg, *, on_cpu: bool) -> dict[str, str]:
        """The environment the host gives its Ray processes."""

    def without_metrics_scraping(self, cfg) -> None:
        """Turn off (in `cfg`) whatever of the host reads Ray's metrics agents, for runs that start Ray
        without metrics collection. Default: nothing reads them."""

    def sync_registries(self) -> None:
        """Make user-registered losses/estimators visible in Ray processes (after ``ray.init``)."""

    @abstractmethod
    def base_experiment_class(self) -> type:
        """The host's experiment class (``BasePPOExp``): builds the trainer from a config and runs it."""

    @abstractmethod
    def trainer_class(self) -> type:
        """The host's ``RayPPOTrainer``."""

    @abstractmethod
    def training_input_class(self) -> type:
        """The host's ``TrainingInputBatch`` (what its trainer hands the workers)."""

    def worker_classes(self, strategy: str) -> tuple[Any, Any, Any]:
        """(policy, critic, ref) classes the host would build for `strategy`."""
        if strategy not in self.strategies:
            raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(self.strategies)}")
        module_name = self.megatron_worker_module if strategy == "megatron" else self.strategy_worker_modules[strategy]
        module = importlib.import_module(module_name)
        return module.PolicyWorker, module.CriticWorker, module.RefWorker

    # -- worker side ------------------------------------------------------------------------------

    @abstractmethod
    def worker_bases(self) -> tuple[type, type, type]:
        """(PolicyWorkerBase, RefWorkerBase, CriticWorkerBase): the host's worker contract."""

    @abstractmethod
    def make_mesh_rank(self, *, dp: int, cp: int, tp: int, pp: int, world_size: int, dp_size: int, pp_size: int):
        """The host's MeshRank; the host collects from ``sp == 0``, so a Megatron rank puts its CP rank there."""

    @abstractmethod
    def training_output(self, tensors: dict | None = None, metadata: dict | None = None):
        """The host's ``TrainingOutputBatch`` holding `tensors`, with `metadata`."""

    def scoring_output(self, key: str, values, metadata: dict):
        """What a worker's ``forward`` returns for per-token `values` [B, A] (``key``: logprobs or values)."""
        return self.training_output({"output": values}, metadata)

    def engine_routes(self, data) -> tuple[list, list] | None:
        """MoE routes the inference engine returned for a batch's rows (routing replay R3): per row
        the routes [n, layers, k] of its first n real tokens and which real tokens those are
        ([real tokens] bool); None where the batch carries none. Default: this host carries none."""
        return None

    @abstractmethod
    def policy_loss_function(self, name: str) -> Callable:
        """The host's registered policy loss `name` (regular, dual_clip, gspo, cispo, ... or a user's)."""

    def critic_loss_function(self) -> Callable:
        """The host's value loss, ``(values, old_values, returns, config, loss_mask) -> (loss, clipfrac)``."""
        raise HostFeatureMissing(self, "the Megatron critic", "use skyrl-train 0.3.1 for PPO with a critic")

    @abstractmethod
    def masked_mean(self, tensor, mask, dim=None):
        """The host's masked mean (its loss reductions are built on it)."""

    @abstractmethod
    def approx_kl(self, log_probs, base_log_probs, loss_mask, estimator: str):
        """The host's KL estimator, with gradients."""

    def weight_chunk(self, bucket):
        raise HostFeatureMissing(self, "weight sync through the host's transfer strategies", "use skyrl-train 0.3.1")

    def inference_engine_interface(self) -> type:
        raise HostFeatureMissing(self, "the CPU generation engine", "use skyrl-train 0.3.1")

    def weight_update_request_base(self) -> type:
        raise HostFeatureMissing(self, "the CPU generation engine", "use skyrl-train 0.3.1")

    def lora_load_request_class(self) -> type:
        raise HostFeatureMissing(self, "LoRA adapter sync", "use skyrl-train 0.3.1")

    def ray_wrapped_inference_engine(self, actor):
        raise HostFeatureMissing(self, "the CPU generation engine", "use skyrl-train 0.3.1")

    def broadcast_init_info_class(self) -> type:
        raise HostFeatureMissing(self, "broadcast weight sync", "use skyrl-train 0.3.1")

    def cuda_ipc_init_info_class(self) -> type:
        raise HostFeatureMissing(self, "CUDA IPC weight sync to our engine", "use skyrl-train 0.3.1")

    def cuda_ipc_update_request_class(self) -> type:
        raise HostFeatureMissing(self, "CUDA IPC weight sync to our engine", "use skyrl-train 0.3.1")

    def broadcast_update_request_class(self) -> type:
        raise HostFeatureMissing(self, "broadcast weight sync", "use skyrl-train 0.3.1")

    def join_weight_broadcast_group(self, init_info):
        raise HostFeatureMissing(self, "broadcast weight sync", "use skyrl-train 0.3.1")

    def weight_sync_bucket_bytes(self, cfg, strategy_cls) -> int:
        raise HostFeatureMissing(self, "weight sync through the host's transfer strategies", "use skyrl-train 0.3.1")

    @abstractmethod
    def generator_dtype(self, cfg):
        """The dtype the inference engines hold their weights in."""


def yaml_scalar(value: bool | int | float | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
