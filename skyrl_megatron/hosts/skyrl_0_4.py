"""The adapter for skyrl 0.4.x (October 2026): the trainer lives in ``skyrl.train`` and
``skyrl.backends.skyrl_train``, configs are typed dataclasses, workers train through
``forward_backward`` + ``optim_step``, and inference runs behind HTTP servers.

Our config keys ride on the host's dataclasses (``hosts/skyrl_0_4_config.py``). Our workers and
checks read a config in one shape, the one skyrl-train 0.3.1 composes; :meth:`SkyRL04.our_view`
builds that view from a 0.4 config, so the translation between the two lives here only.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import re
from typing import Any, Callable

from skyrl_megatron.hosts.base import HostAdapter, HostRelease, LocalEngineFactories, yaml_scalar
from skyrl_megatron.hosts.fixes import allow_flash_attn_import_without_kernels, give_router_args_a_pd_flag

RELEASE = HostRelease(
    distribution="skyrl",
    version_prefix="0.4",
    label="skyrl 0.4.x",
    install='pip install "skyrl[skyrl-train]>=0.4,<0.5"',
)

_MEGATRON_KEY = re.compile(r"^\+*trainer\.(policy|ref|critic)\.megatron_config\.([A-Za-z_0-9]+)[.=]")

# The host's flat MoE fields and the moe_config keys of ours that carry the same meaning.
_HOST_MOE_FIELDS = {
    "moe_token_dispatcher_type": "token_dispatcher",
    "moe_router_dtype": "router_dtype",
    "moe_router_load_balancing_type": "load_balancing_type",
    "moe_aux_loss_coeff": "aux_loss_coeff",
    "freeze_moe_router": "freeze_router",
    "moe_router_enable_expert_bias": "expert_bias",
}
# Host fields for features of its own backend that ours does not have: a non-default value is refused.
# (``async_dist_ckpt_save`` is our ``async_save``; ``async_save_prestage_to_cpu`` is what ours always does:
# the training process copies the state to host memory before the background write.)
_HOST_ONLY_FIELDS = (
    "fp8", "fp8_recipe", "fp8_param", "fp8_amax_compute_algo", "mtp_num_layers", "freeze_dsa_indexer",
    "dist_ckpt_optim_fully_reshardable",
    "moe_per_layer_logging", "hf_export_config", "moe_router_score_function",
    "moe_grouped_gemm", "mtp_loss_weight", "mtp_loss_chunk_size", "mtp_loss_topk",
)


# our vLLM worker extension (a name: the hosts do not import the engines)
WEIGHT_READ_BACK = "skyrl_megatron.engines.vllm_extension.WeightReadBack"

# 0.3.1's flat generator keys (our view of a config has them) and their 0.4 names under
# generator.inference_engine.
_ENGINE_KEYS = {
    "model_dtype": "model_dtype",
    "num_inference_engines": "num_engines",
    "enable_prefix_caching": "enable_prefix_caching",
    "weight_sync_backend": "weight_sync_backend",
    "run_engines_locally": "run_engines_locally",
    "backend": "backend",
    "inference_engine_tensor_parallel_size": "tensor_parallel_size",
    "inference_engine_pipeline_parallel_size": "pipeline_parallel_size",
    "inference_engine_data_parallel_size": "data_parallel_size",
    "inference_engine_expert_parallel_size": "expert_parallel_size",
    "enable_return_routed_experts": "enable_return_routed_experts",  # (0.4 only: engine routes for R3)
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    # 0.4 is always async: its own parse drops `async_engine=true` and refuses `false` with its message
    "async_engine": "async_engine",
}


class SkyRL04(HostAdapter):
    release = RELEASE
    megatron_worker_module = "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"
    entrypoint_module = "skyrl.train.entrypoints.main_base"
    host_main = "python -m skyrl.train.entrypoints.main_base"
    strategies = ("fsdp", "fsdp2", "megatron")
    strategy_worker_modules = {
        "fsdp": "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker",
        "fsdp2": "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker",
    }
    hf_model_wrapper_module = "skyrl.backends.skyrl_train.workers.model_wrapper"
    torch_utils_module = "skyrl.backends.skyrl_train.utils.torch_utils"
    policy_losses_are_presummed = True

    def apply_compat_fixes(self) -> None:
        allow_flash_attn_import_without_kernels()
        give_router_args_a_pd_flag()

    def import_patches(self, engines: LocalEngineFactories) -> dict[str, Callable[[Any], None]]:
        return {self.entrypoint_module: functools.partial(_route_local_engines, engine_client=engines.engine_client)}

    # -- config -----------------------------------------------------------------------------------

    def config_class(self) -> type:
        from skyrl_megatron.hosts.skyrl_0_4_config import SkyRLMegatronConfig

        return SkyRLMegatronConfig

    def compose_config(self, overrides: list[str]):
        """The host's strict parse into our extended config class.

        An unknown key inside a worker's ``megatron_config`` is reported by us first, with the closest
        valid key (the host's parser would list every valid field instead).
        """
        _refuse_unknown_megatron_keys(overrides)
        return self.config_class().from_cli_overrides(self.in_host_names(overrides))

    def light_config(self, overrides: list[str]):
        """The same parse without the host's root post-init, which imports torch (see
        ``SkyRLMegatronLightConfig``): our checks read every field they need from it."""
        from skyrl_megatron.hosts.skyrl_0_4_config import SkyRLMegatronLightConfig

        _refuse_unknown_megatron_keys(overrides)
        return SkyRLMegatronLightConfig.from_cli_overrides(self.in_host_names(overrides))

    def in_host_names(self, overrides: list[str]) -> list[str]:
        """skyrl-train 0.3.1's flat engine keys (``generator.weight_sync_backend=gloo``) under the names 0.4
        gave them (``generator.inference_engine.weight_sync_backend``), so one command line serves both hosts."""
        names = self.host_key_names()
        renamed = []
        for override in overrides:
            key, sep, value = override.partition("=")
            prefix = key[: len(key) - len(key.lstrip("+~"))]
            renamed.append(f"{prefix}{names.get(key[len(prefix):], key[len(prefix):])}{sep}{value}")
        return renamed

    def unsupported_settings(self, cfg) -> list[tuple[str, Any]]:
        """Host fields of its built-in Megatron backend that ours does not implement, set away from their defaults."""
        from skyrl.train.config.config import MegatronConfig

        defaults = MegatronConfig()
        found = []
        for role in ("policy", "ref", "critic"):
            section = getattr(getattr(cfg.trainer, role), "megatron_config", None)
            for name in _HOST_ONLY_FIELDS if section is not None else ():
                value = getattr(section, name)
                if value != getattr(defaults, name):
                    found.append((f"trainer.{role}.megatron_config.{name}", value))
        return found

    def our_view(self, cfg):
        """The config in skyrl-train 0.3.1's shape (an OmegaConf DictConfig) for our checks and workers."""
        from omegaconf import OmegaConf

        tree = dataclasses.asdict(cfg)
        tree["trainer"] = _our_trainer_section(tree["trainer"])
        generator = tree["generator"]
        engine = generator.get("inference_engine") or {}
        for ours, theirs in _ENGINE_KEYS.items():
            generator.setdefault(ours, engine.get(theirs))
        return OmegaConf.create(tree)

    def small_prompt_file_overrides(self) -> list[str]:
        """0.4's loader spawns its worker processes (8 by default) afresh each epoch, each importing torch and the
        host: seconds of start per epoch on a GPU machine's cores, more on a small CPU box, for rows a prompt file
        of tens of prompts has long tokenized. Loaded in the trainer's process instead."""
        return ["data.dataloader.num_workers=0"]

    def engine_sampling_overrides(self, settings: dict[str, bool | int | float | str]) -> list[str]:
        """0.4 takes no new keys; its engines get `generator.sampling_params.additional_kwargs` as they are."""
        if not settings:
            return []
        pairs = ", ".join(f"{name}: {yaml_scalar(value)}" for name, value in settings.items())
        return [f"generator.sampling_params.additional_kwargs={{{pairs}}}"]

    def vllm_engine_overrides(self) -> list[str]:
        """0.4 serves its vLLM engines over HTTP, always asynchronous. Its worker extension plus our read-back of
        the engine's weights (`engines.vllm_extension`: the demo checks each sync through ``/collective_rpc``).
        One GPU per engine needs no Ray executor inside the engine: vLLM 0.24's, started in the engine-core
        process, cannot read 0.4's placement group."""
        return [
            "generator.inference_engine.distributed_executor_backend=mp",
            f"generator.inference_engine.engine_init_kwargs={{worker_extension_cls: {WEIGHT_READ_BACK}}}",
        ]

    def vllm_worker_extension_class(self) -> type:
        from skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap import NewInferenceWorkerWrap

        return NewInferenceWorkerWrap

    def host_key_names(self) -> dict[str, str]:
        names = {f"generator.{ours}": f"generator.inference_engine.{theirs}" for ours, theirs in _ENGINE_KEYS.items()}
        # our view's packing flag is 0.4's remove_microbatch_padding (0.4 keeps use_sample_packing as a deprecated alias)
        return names | {"trainer.use_sample_packing": "trainer.remove_microbatch_padding"}

    def worker_view(self, worker_cfg):
        """A worker gets the host's ``TrainerConfig`` only (``cfg.trainer``); the sampling temperature
        is its ``algorithm.temperature``."""
        from omegaconf import OmegaConf

        trainer = _our_trainer_section(dataclasses.asdict(worker_cfg))
        generator = {"sampling_params": {"temperature": worker_cfg.algorithm.temperature}, "enable_prefix_caching": False}
        return OmegaConf.create({"trainer": trainer, "generator": generator})

    def algorithm_config(self, worker_cfg):
        return worker_cfg.algorithm

    # -- driver side ------------------------------------------------------------------------------

    def validate(self, cfg) -> None:
        """The host's `validate_cfg` without its Megatron section (vLLM + NCCL only, no critic:
        limits of its built-in backend, not of ours). Its batch-size rules size a critic's DP as its
        FSDP critic's (world / ``critic.sequence_parallel_size``); a Megatron critic's DP is world /
        (TP*PP*CP), put in that place for the duration of the host's checks."""
        from skyrl.train.utils import utils as host_utils

        from skyrl_megatron.config import ConfigError, Problem

        if getattr(cfg.generator, "engine", "auto") == "gpu" and cfg.trainer.placement.colocate_all:
            raise ConfigError([Problem(
                "trainer.placement.colocate_all",
                "generator.engine=gpu shares a GPU with the trainers only on skyrl-train 0.3.1 (through its CUDA IPC "
                "sender); on skyrl 0.4 our HF engine takes a GPU of its own",
                "set trainer.placement.colocate_all=false (the engine then needs a free GPU)",
            )])

        original = host_utils.validate_megatron_cfg
        host_utils.validate_megatron_cfg = lambda cfg: None
        critic_sp = _present_megatron_critic_dp(cfg)
        executor = _present_hf_engine_executor(cfg)
        try:
            host_utils.validate_cfg(cfg)
        finally:
            host_utils.validate_megatron_cfg = original
            if critic_sp is not None:
                cfg.trainer.critic.sequence_parallel_size = critic_sp
            if executor is not None:
                cfg.generator.inference_engine.distributed_executor_backend = executor

    def ray_env_vars(self, cfg, *, on_cpu: bool) -> dict[str, str]:
        from skyrl.train.utils.utils import prepare_runtime_environment

        if on_cpu:
            # the host probes GPU peer access when a role spans several GPUs of a node, by starting Ray
            # and waiting for two GPUs; a CPU run has none, so it is asked as if each role had one
            cfg = copy.deepcopy(cfg)
            cfg.generator.inference_engine.tensor_parallel_size = 1
            for role in ("policy", "critic", "ref"):
                setattr(cfg.trainer.placement, f"{role}_num_gpus_per_node", 1)
        return prepare_runtime_environment(cfg)

    def without_metrics_scraping(self, cfg) -> None:
        cfg.generator.inference_engine.enable_ray_prometheus_stats = False

    def sync_registries(self) -> None:
        from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

        sync_registries()

    def base_experiment_class(self) -> type:
        from skyrl.train.entrypoints.main_base import BasePPOExp

        return BasePPOExp

    def trainer_class(self) -> type:
        from skyrl.train.trainer import RayPPOTrainer

        return RayPPOTrainer

    def training_input_class(self) -> type:
        from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

        return TrainingInputBatch

    # -- worker side ------------------------------------------------------------------------------

    def worker_bases(self):
        from skyrl.backends.skyrl_train.workers.worker import CriticWorkerBase, PolicyWorkerBase, RefWorkerBase

        return PolicyWorkerBase, RefWorkerBase, CriticWorkerBase

    def make_mesh_rank(self, *, dp, cp, tp, pp, world_size, dp_size, pp_size):
        from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank

        return MeshRank(dp=dp, sp=cp, tp=tp, pp=pp, world_size=world_size, dp_size=dp_size, pp_size=pp_size)

    def training_output(self, tensors=None, metadata=None):
        from skyrl.backends.skyrl_train.training_batch import TrainingOutputBatch

        out = TrainingOutputBatch(tensors or {})
        out.metadata = metadata or {}
        return out

    def scoring_output(self, key: str, values, metadata: dict):
        """0.4 collects per-sample lists (``loss_fn_outputs``) and pads them back into a tensor."""
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput

        return WorkerOutput(loss_fn_outputs=[{key: row.tolist()} for row in values], metrics={})

    def engine_routes(self, data):
        """``rollout_expert_indices`` (a PackedTensor: one segment of routes per row, as long as the row's
        real tokens, its tail past the engine's routes dummy) and ``router_padding_mask`` (True: no
        engine route, left padding included), as the trainer's ``convert_to_training_input`` made them."""
        packed = data.get("rollout_expert_indices")
        if packed is None:
            return None
        no_route = data.get("router_padding_mask")
        mask = data["attention_mask"].bool().cpu()
        if no_route is None:
            raise ValueError("the batch carries rollout_expert_indices without router_padding_mask")
        segments = [packed.segment(i).cpu() for i in range(len(packed))]
        captured = [~row_no_route.cpu()[row_mask] for row_no_route, row_mask in zip(no_route.bool(), mask)]
        return segments, captured

    def training_status(self, metrics: dict[str, float]):
        """0.4's ``forward_backward`` result: scalar metrics, already reduced over DP ranks."""
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput

        return WorkerOutput(loss_fn_outputs=[], metrics=dict(metrics))

    def policy_loss_function(self, name: str):
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

        return PolicyLossRegistry.get(name)

    def critic_loss_function(self):
        from skyrl.backends.skyrl_train.utils.ppo_utils import ppo_critic_loss

        return ppo_critic_loss

    def masked_mean(self, tensor, mask, dim=None):
        from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean

        return masked_mean(tensor, mask, dim=dim)

    def approx_kl(self, log_probs, base_log_probs, loss_mask, estimator: str):
        from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl

        fn = getattr(compute_approx_kl, "__wrapped__", compute_approx_kl)
        return fn(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=estimator)

    def inference_engine_interface(self) -> type:
        from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface

        return InferenceEngineInterface

    def generator_dtype(self, cfg):
        from skyrl.train.utils.utils import str_to_torch_dtype

        return str_to_torch_dtype(cfg.generator.inference_engine.model_dtype)


def _refuse_unknown_megatron_keys(overrides: list[str]) -> None:
    """A key of a worker's ``megatron_config`` that neither the host nor we have, named with the closest one."""
    from skyrl_megatron.config import ConfigError, Problem, closest
    from skyrl_megatron.hosts.skyrl_0_4_config import MegatronSettings

    known = {f.name for f in dataclasses.fields(MegatronSettings)}
    problems = []
    for arg in overrides:
        match = _MEGATRON_KEY.match(arg)
        if match and match.group(2) not in known:
            hint = closest(match.group(2), known)
            problems.append(Problem(arg.split("=", 1)[0], "unknown key", f"did you mean '{hint}'?" if hint else "remove it"))
    if problems:
        raise ConfigError(problems)


def _present_megatron_critic_dp(cfg):
    """Put a Megatron critic's DP divisor (TP*PP*CP) where the host reads its critic's; the value to
    restore (None: nothing changed)."""
    critic = cfg.trainer.critic
    if cfg.trainer.strategy != "megatron" or not critic.model.path:
        return None
    m = critic.megatron_config
    original = critic.sequence_parallel_size
    critic.sequence_parallel_size = (
        int(m.tensor_model_parallel_size) * int(m.pipeline_model_parallel_size) * int(m.context_parallel_size)
    )
    return original


def _present_hf_engine_executor(cfg):
    """The host requires vLLM's ``mp`` executor with engine routes (R3: its ``ray`` one can hang); our HF
    engine (``generator.engine=cpu|gpu``) has no vLLM executor, so the rule is met for the host's checks.
    The value to restore (None: nothing changed)."""
    engine = cfg.generator.inference_engine
    if getattr(cfg.generator, "engine", "auto") not in ("cpu", "gpu") or not engine.enable_return_routed_experts:
        return None
    original = engine.distributed_executor_backend
    engine.distributed_executor_backend = "mp"
    return original


def _our_trainer_section(trainer: dict[str, Any]) -> dict[str, Any]:
    trainer["use_sample_packing"] = trainer.pop("remove_microbatch_padding", False)
    for role in ("policy", "ref", "critic"):
        section = trainer[role].get("megatron_config")
        if section is not None:
            trainer[role]["megatron_config"] = our_megatron_section(section)
    return trainer


def our_megatron_section(section: dict[str, Any]) -> dict[str, Any]:
    """A 0.4 ``megatron_config`` (as a dict) in our schema.

    The host's flat MoE fields become our ``moe_config`` keys unless ``moe_config`` sets them itself;
    ``lora_config.merge_lora`` becomes ``weight_sync`` unless that is set; the host-only fields are
    dropped (a user's non-default value is refused by :meth:`SkyRL04.unsupported_settings`; the host's
    own validation may set some, e.g. ``mtp_num_layers``).
    """
    from skyrl.train.config.config import MegatronConfig

    host_defaults = dataclasses.asdict(MegatronConfig())
    ours = dict(section)
    from_host = {}
    for host_key, our_key in _HOST_MOE_FIELDS.items():
        value = ours.pop(host_key, None)
        if value is not None and value != host_defaults.get(host_key):
            from_host[our_key] = value
    # the host's router replay alone is our R2 (with the engines' routes, SkyRLMegatronConfig made it r3 already)
    if ours.pop("moe_enable_routing_replay", False):
        from_host["routing_replay"] = "r2"
    moe = ours.get("moe_config") or {}
    # anything but a mapping (`moe_config=fast`) stays as given: our checks name it ("must be a mapping")
    if isinstance(moe, dict):
        ours["moe_config"] = {**from_host, **moe}  # keys moe_config sets itself win
    # the host's spelling of an asynchronous checkpoint save (either one turns it on)
    if ours.pop("async_dist_ckpt_save", False):
        ours["async_save"] = True
    ours.pop("async_save_prestage_to_cpu", None)
    lora = dict(ours.get("lora_config") or {})
    merge = lora.pop("merge_lora", True)
    if lora.get("weight_sync") is None:
        lora["weight_sync"] = "merged" if merge else "adapters"
    ours["lora_config"] = {k: v for k, v in lora.items() if k in ("lora_type", "weight_sync")}
    for key in _HOST_ONLY_FIELDS:  # set away from its default, validation refused it already (unsupported_settings)
        ours.pop(key, None)
    return ours


def _route_local_engines(main_base, engine_client) -> None:
    """Let ``generator.engine=cpu|gpu`` give the host our engine client where it would start vLLM servers.

    ``BasePPOExp.get_inference_client`` is the host's hook for custom clients; wrapping it on the class
    serves the host's experiment and users' subclasses alike (a subclass that overrides it wins).
    """
    experiment = main_base.BasePPOExp
    original = experiment.get_inference_client
    if getattr(original, "_skyrl_megatron_routed", False):
        return

    @functools.wraps(original)
    def get_inference_client(self):
        cfg = self.cfg
        engine = getattr(cfg.generator, "engine", "auto")
        if engine not in ("cpu", "gpu"):
            return original(self)
        settings = cfg.generator.inference_engine
        client = engine_client(settings.num_engines, cfg.trainer.policy.model.path, dtype=settings.model_dtype,
                               seed=cfg.trainer.seed, device="cuda" if engine == "gpu" else "cpu",
                               return_routed_experts=bool(settings.enable_return_routed_experts))
        if cfg.trainer.placement.colocate_all:
            asyncio.run(client.sleep())  # as the host leaves its own engines after start-up
        return client

    get_inference_client._skyrl_megatron_routed = True  # type: ignore[attr-defined]
    experiment.get_inference_client = get_inference_client
