"""The adapter for skyrl-train 0.3.1 (January 2026): Hydra/OmegaConf configs, ``ppo_train`` workers,
engines as Ray actors behind ``InferenceEngineInterface``, weight sync through transfer strategies.

Besides the touch points, this module holds the fixes that 0.3.1's own code needs on our
dependency set (transformers 5, torch >= 2.10, flash-attn without its CUDA build); each says why.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from typing import Any, Callable

from skyrl_megatron.hosts.base import HostAdapter, HostRelease, LocalEngineFactories
from skyrl_megatron.hosts.batch_pickling import pickle_batches_once
from skyrl_megatron.hosts.fixes import allow_flash_attn_import_without_kernels

RELEASE = HostRelease(
    distribution="skyrl-train",
    version_prefix="0.3.1",
    label="skyrl-train 0.3.1",
    install='pip install "skyrl-train==0.3.1"',
)

_MEGATRON_KEY = re.compile(r"^trainer\.(policy|ref|critic)\.megatron_config\.[^=]+=")
_TRAINER_UTILS_MODULE = "skyrl_train.utils.trainer_utils"
_TOKENIZER_MODULE = "transformers.tokenization_utils_base"
_FSDP_STRATEGY_MODULE = "skyrl_train.distributed.fsdp_strategy"
_FSDP_UTILS_MODULE = "skyrl_train.distributed.fsdp_utils"
_DISTRIBUTED_UTILS_MODULE = "skyrl_train.distributed.utils"
_TRAINING_BATCH_MODULE = "skyrl_train.training_batch"
_HOST_PACKAGES = ("skyrl_train.", "skyrl_gym.")


def standalone_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                             group_name=None, pg_options=None):
    """A process group of its own (not a subgroup of the default world): trainer rank 0 + engines."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, default_pg_timeout

    timeout = timeout or default_pg_timeout
    if store is None:
        store, rank, world_size = next(rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend or "undefined"), store,
        group_name=group_name, backend_options=pg_options, timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


standalone_process_group._skyrl_megatron_fixed = True  # type: ignore[attr-defined]


class SkyRLTrain03(HostAdapter):
    release = RELEASE
    megatron_worker_module = "skyrl_train.workers.megatron.megatron_worker"
    entrypoint_module = "skyrl_train.entrypoints.main_base"
    host_main = "python -m skyrl_train.entrypoints.main_base"
    strategies = ("fsdp", "fsdp2", "deepspeed", "megatron")
    strategy_worker_modules = {
        "fsdp": "skyrl_train.workers.fsdp.fsdp_worker",
        "fsdp2": "skyrl_train.workers.fsdp.fsdp_worker",
        "deepspeed": "skyrl_train.workers.deepspeed.deepspeed_worker",
    }
    hf_model_wrapper_module = "skyrl_train.model_wrapper"
    torch_utils_module = "skyrl_train.utils.torch_utils"

    def __init__(self) -> None:
        self._compat_done = False

    # -- activation ------------------------------------------------------------------------------

    def import_patches(self, engines: LocalEngineFactories) -> dict[str, Callable[[Any], None]]:
        return {
            self.entrypoint_module: functools.partial(_route_local_engines, cpu_engines=engines.ray_wrapped_engines),
            _TOKENIZER_MODULE: _legacy_chat_template_for_host,
            _FSDP_STRATEGY_MODULE: _rebind_fsdp2_wrap,
            _FSDP_UTILS_MODULE: _fix_fsdp_utils,
            _DISTRIBUTED_UTILS_MODULE: _fix_custom_process_group,
            _TRAINER_UTILS_MODULE: _size_dataloader_workers_to_the_machine,
            _TRAINING_BATCH_MODULE: _pickle_training_batches_once,
        }

    def apply_compat_fixes(self) -> None:
        """Fixes for skyrl-train 0.3.1 that its own imports need on our dependency set."""
        if self._compat_done:
            return
        allow_flash_attn_import_without_kernels()
        # The other fixes patch host modules as they are imported (`import_patches`): importing them here
        # would cost every Ray worker process torch, transformers and peft at start-up (about 7 s of CPU).
        # `activate()` applies them at once to those imported before it.
        self._compat_done = True

    # -- config -----------------------------------------------------------------------------------

    #: Hydra's config directory and root config: the host's ``ppo_base_config`` plus our megatron group
    hydra_config_name = "skyrl_megatron"

    def hydra_config_dir(self) -> str:
        from importlib import resources

        return str(resources.files("skyrl_megatron.conf"))

    def hydra_overrides(self, argv: list[str]) -> list[str]:
        """Keys inside a worker's megatron_config are checked by our validator, which names the closest
        valid key on a typo. Hydra's struct mode would reject such a key first with a less helpful
        message, so overrides of these keys are passed to Hydra as add-or-override ("++")."""
        return [f"++{arg}" if _MEGATRON_KEY.match(arg) else arg for arg in argv]

    def compose_config(self, overrides: list[str]):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=self.hydra_config_dir(), version_base="1.3", job_name="skyrl_megatron"):
            return compose(config_name=self.hydra_config_name, overrides=self.hydra_overrides(list(overrides)))

    # -- driver side ------------------------------------------------------------------------------

    def validate(self, cfg) -> None:
        """The host's `validate_cfg` with its Megatron section swapped out.

        The host's `validate_megatron_cfg` forbids a critic and requires vLLM + NCCL weight sync; those
        are limitations of the host's built-in Megatron path, not of ours. Its batch-size rules size a
        critic's DP as its FSDP critic's (world / ``critic.sequence_parallel_size``); a Megatron critic's
        DP size is world / (TP*PP*CP), put in that place for the duration of the host's checks (our
        rules check the rest of the critic).
        """
        from skyrl_train.utils import utils as host_utils

        original = host_utils.validate_megatron_cfg
        host_utils.validate_megatron_cfg = lambda cfg: None
        critic_sp = _present_megatron_critic_dp(cfg)
        try:
            host_utils.validate_cfg(cfg)
        finally:
            host_utils.validate_megatron_cfg = original
            if critic_sp is not None:
                cfg.trainer.critic.sequence_parallel_size = critic_sp

    def ray_env_vars(self, cfg, *, on_cpu: bool) -> dict[str, str]:
        from skyrl_train.utils.utils import prepare_runtime_environment

        # On CPU the host would probe GPU peer access through Ray (on a GPU-less driver) to tune NCCL;
        # with one GPU per node it skips the probe. NCCL settings mean nothing to gloo.
        return prepare_runtime_environment(_single_gpu_per_node(cfg) if on_cpu else cfg)

    def sync_registries(self) -> None:
        from skyrl_train.utils.ppo_utils import sync_registries

        sync_registries()

    def base_experiment_class(self) -> type:
        from skyrl_train.entrypoints.main_base import BasePPOExp

        return BasePPOExp

    def trainer_class(self) -> type:
        from skyrl_train.trainer import RayPPOTrainer

        return RayPPOTrainer

    def training_input_class(self) -> type:
        from skyrl_train.training_batch import TrainingInputBatch

        return TrainingInputBatch

    # -- worker side ------------------------------------------------------------------------------

    def worker_bases(self):
        from skyrl_train.workers.worker import CriticWorkerBase, PolicyWorkerBase, RefWorkerBase

        return PolicyWorkerBase, RefWorkerBase, CriticWorkerBase

    def make_mesh_rank(self, *, dp, cp, tp, pp, world_size, dp_size, pp_size):
        from skyrl_train.distributed.dispatch import MeshRank

        return MeshRank(dp=dp, sp=cp, tp=tp, pp=pp, world_size=world_size, dp_size=dp_size, pp_size=pp_size)

    def training_output(self, tensors=None, metadata=None):
        from skyrl_train.training_batch import TrainingOutputBatch

        out = TrainingOutputBatch(tensors or {})
        out.metadata = metadata or {}
        return out

    def policy_loss_function(self, name: str):
        from skyrl_train.utils.ppo_utils import PolicyLossRegistry

        return PolicyLossRegistry.get(name)

    def critic_loss_function(self):
        from skyrl_train.utils.ppo_utils import ppo_critic_loss

        return ppo_critic_loss

    def masked_mean(self, tensor, mask, dim=None):
        from skyrl_train.utils.ppo_utils import masked_mean

        return masked_mean(tensor, mask, dim=dim)

    def approx_kl(self, log_probs, base_log_probs, loss_mask, estimator: str):
        """0.3.1 wraps `compute_approx_kl` in ``torch.no_grad()``, so its KL loss trains nothing; we call
        the undecorated function (kept by functools.wraps as ``__wrapped__``)."""
        from skyrl_train.utils.ppo_utils import compute_approx_kl

        fn = getattr(compute_approx_kl, "__wrapped__", compute_approx_kl)
        return fn(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=estimator)

    def weight_chunk(self, bucket):
        from skyrl_train.weight_sync import WeightChunk

        return WeightChunk(names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes, tensors=bucket.tensors)

    def inference_engine_interface(self):
        from skyrl_train.inference_engines.base import InferenceEngineInterface

        return InferenceEngineInterface

    def weight_update_request_base(self):
        from skyrl_train.weight_sync.base import WeightUpdateRequest

        return WeightUpdateRequest

    def lora_load_request_class(self):
        from skyrl_train.weight_sync.base import LoraLoadRequest

        return LoraLoadRequest

    def ray_wrapped_inference_engine(self, actor):
        from skyrl_train.inference_engines.ray_wrapped_inference_engine import RayWrappedInferenceEngine

        return RayWrappedInferenceEngine(actor)

    def broadcast_init_info_class(self):
        from skyrl_train.weight_sync import BroadcastInitInfo

        return BroadcastInitInfo

    def cuda_ipc_init_info_class(self):
        from skyrl_train.weight_sync import CudaIpcInitInfo

        return CudaIpcInitInfo

    def cuda_ipc_update_request_class(self):
        from skyrl_train.weight_sync import CudaIpcWeightUpdateRequest

        return CudaIpcWeightUpdateRequest

    def broadcast_update_request_class(self):
        from skyrl_train.weight_sync import BroadcastWeightUpdateRequest

        return BroadcastWeightUpdateRequest

    def join_weight_broadcast_group(self, init_info):
        """Join the host's weight-broadcast group as an engine of one rank, outside any default group."""
        from skyrl_train.utils import get_tcp_url

        return standalone_process_group(
            backend=init_info.backend,
            init_method=get_tcp_url(init_info.master_addr, init_info.master_port),
            world_size=init_info.world_size,
            rank=init_info.rank_offset,
            group_name=init_info.group_name,
        )

    def weight_sync_bucket_bytes(self, cfg, strategy_cls) -> int:
        """The broadcast sender takes one tensor per chunk (a 1-byte budget); CUDA IPC packs a chunk
        into one buffer, sized by the host's threshold."""
        from skyrl_train.weight_sync import CudaIpcTransferStrategy

        if strategy_cls is CudaIpcTransferStrategy:
            return max(1, int(float(cfg.generator.weight_transfer_threshold_cuda_ipc_GB) * 2**30))
        return 1

    def generator_dtype(self, cfg):
        from skyrl_train.utils import str_to_torch_dtype

        return str_to_torch_dtype(cfg.generator.model_dtype)


# ----------------------------------------------------------------------------------------------
# Compatibility fixes for 0.3.1 on our dependency set
# ----------------------------------------------------------------------------------------------


def _present_megatron_critic_dp(cfg):
    """Put a Megatron critic's DP divisor where the host reads its critic's; the value to restore (None:
    nothing changed)."""
    from skyrl_megatron.config import megatron_dp_divisor

    if cfg.trainer.strategy != "megatron" or not cfg.trainer.critic.model.get("path"):
        return None
    original = cfg.trainer.critic.sequence_parallel_size
    cfg.trainer.critic.sequence_parallel_size = megatron_dp_divisor(cfg, "critic")
    return original


def _single_gpu_per_node(cfg):
    from omegaconf import OmegaConf, open_dict

    view = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(view):
        view.generator.inference_engine_tensor_parallel_size = 1
        for role in ("policy", "critic", "ref"):
            view.trainer.placement[f"{role}_num_gpus_per_node"] = 1
    return view


def _route_local_engines(main_base, cpu_engines) -> None:
    """Let ``generator.engine=cpu|gpu`` put our HF engine where the host would start vLLM/SGLang.

    The host looks the factory up as a module global at call time, so every BasePPOExp (the host's
    and users' subclasses) picks the engine from the config.
    """
    original = main_base.create_ray_wrapped_inference_engines_from_config
    if getattr(original, "_skyrl_megatron_routed", False):
        return

    def create_ray_wrapped_inference_engines_from_config(cfg, colocate_pg, tokenizer):
        engine = cfg.generator.get("engine", "auto")
        if engine not in ("cpu", "gpu"):
            return original(cfg, colocate_pg, tokenizer)
        return cpu_engines(
            cfg.generator.num_inference_engines,
            cfg.trainer.policy.model.path,
            dtype=cfg.generator.model_dtype,
            seed=cfg.trainer.seed,
            device="cuda" if engine == "gpu" else "cpu",
            colocate_pg=colocate_pg if engine == "gpu" else None,
        )

    create_ray_wrapped_inference_engines_from_config._skyrl_megatron_routed = True  # type: ignore[attr-defined]
    create_ray_wrapped_inference_engines_from_config.__wrapped__ = original  # type: ignore[attr-defined]
    main_base.create_ray_wrapped_inference_engines_from_config = create_ray_wrapped_inference_engines_from_config


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


def _size_dataloader_workers_to_the_machine(trainer_utils) -> None:
    """0.3.1's ``build_dataloader`` starts 8 loader worker processes whatever the machine; on a small
    one (2 cores in CI) torch warns on every epoch and the processes only compete for cores. Its
    loader gets at most one worker per core; the batches are the same (the sampler is seeded)."""
    loader_cls = trainer_utils.StatefulDataLoader
    if getattr(loader_cls, "_skyrl_megatron_sized", False):
        return

    class StatefulDataLoader(loader_cls):
        _skyrl_megatron_sized = True

        def __init__(self, *args, num_workers: int = 0, **kwargs):
            super().__init__(*args, num_workers=min(num_workers, os.cpu_count() or 1), **kwargs)

    trainer_utils.StatefulDataLoader = StatefulDataLoader


def _pickle_training_batches_once(training_batch) -> None:
    """Every Ray call that carries a batch (scoring, training, on every DP rank) pickled each tensor twice:
    through 0.3.1's ``torch.save``-based ``__getstate__`` and again as a dict item (`batch_pickling`). Once,
    through buffers: a 64 x 4,352-token training batch's dispatch on a 2-core machine went from about 80 to
    25 ms, its scoring fields' from 33 to 19."""
    pickle_batches_once(training_batch.TensorBatch)


def _fix_fsdp_utils(fsdp_utils) -> None:
    """0.3.1's fsdp_strategy imports ``MixedPrecisionPolicy`` from fsdp_utils, which never defines it
    (fixed upstream later); and its ``apply_fsdp2`` needs `_fix_fsdp2_wrap_classes`."""
    if not hasattr(fsdp_utils, "MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_utils.MixedPrecisionPolicy = MixedPrecisionPolicy
    _fix_fsdp2_wrap_classes(fsdp_utils)


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


def _fix_custom_process_group(distributed_utils) -> None:
    """0.3.1's ``init_custom_process_group`` picks torch's keyword by comparing version *strings*.

    ``"2.11.0" >= "2.6"`` is false, so on torch >= 2.10 it passes the removed ``pg_options`` and every
    broadcast weight sync fails. The replacement creates the same stand-alone group (outside the
    default world, ranks mapped one to one) with today's keyword.
    """
    if getattr(distributed_utils.init_custom_process_group, "_skyrl_megatron_fixed", False):
        return
    distributed_utils.init_custom_process_group = standalone_process_group
    strategy = sys.modules.get("skyrl_train.weight_sync.broadcast_strategy")
    if strategy is not None:  # imported the broken function by name before we got here
        strategy.init_custom_process_group = standalone_process_group
