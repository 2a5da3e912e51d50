"""skyrl 0.4's typed config, extended with skyrl-megatron's keys (imports the host: load it lazily).

skyrl 0.4 parses the command line strictly into dataclasses (``SkyRLTrainConfig``) and tells
integrations to subclass them for their own fields. Our worker sections subclass the host's
``MegatronConfig``: every host field keeps its meaning, and our fields are added with the names and
defaults they have on skyrl-train 0.3.1 (read from ``config/megatron/<role>.yaml``, one source).

No ``from __future__ import annotations`` here: the host builds nested configs from real field types.
"""


import copy
import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Dict, Optional

import yaml
from skyrl.train.config.config import (
    CriticConfig,
    GeneratorConfig,
    MegatronConfig,
    MegatronLoraConfig,
    PolicyConfig,
    RefConfig,
    SkyRLTrainConfig,
    TrainerConfig,
)


def _our_defaults(role: str) -> dict[str, Any]:
    text = resources.files("skyrl_megatron.conf").joinpath("megatron", f"{role}.yaml").read_text()
    return yaml.safe_load(text)


@dataclass
class MegatronLoraSettings(MegatronLoraConfig):
    weight_sync: Optional[str] = None
    """merged | adapters (skyrl-megatron's name); null follows the host's ``merge_lora``."""


_WGRAD_FUSION = "gradient_accumulation_fusion"


def _megatron_settings_class() -> type:
    """The host's MegatronConfig plus every key of ours it lacks, with our defaults.

    ``ddp_config`` becomes a mapping: ours is a pass-through to Megatron's DistributedDataParallelConfig
    (any of its fields), the host's a fixed five-field dataclass that only its own validator reads.
    """
    host_fields = {f.name for f in dataclasses.fields(MegatronConfig)}
    ours = _our_defaults("policy")
    ddp_defaults = {**dataclasses.asdict(MegatronConfig().ddp_config), **ours["ddp_config"]}
    # moe_config starts empty: MoeSettings supplies our defaults, and the host's flat moe_* fields,
    # when set, fill the keys that moe_config leaves out
    ours["moe_config"] = {}
    extra = [
        (name, Any, field(default_factory=lambda value=value: copy.deepcopy(value)))
        for name, value in ours.items()
        if name not in host_fields
    ]
    extra.append(("ddp_config", Dict[str, Any], field(default_factory=lambda: copy.deepcopy(ddp_defaults))))
    extra.append(("lora_config", MegatronLoraSettings, field(default_factory=MegatronLoraSettings)))
    transformer_defaults = {k: v for k, v in MegatronConfig().transformer_config_kwargs.items() if k != _WGRAD_FUSION}
    extra.append(("transformer_config_kwargs", Dict[str, Any],
                  field(default_factory=lambda: copy.deepcopy(transformer_defaults))))

    def __post_init__(self) -> None:
        fusion_named = _WGRAD_FUSION in (self.transformer_config_kwargs or {})
        MegatronConfig.__post_init__(self)
        if not fusion_named:
            # the host backfills gradient_accumulation_fusion=False: its own backend has the fused weight-gradient
            # GEMM only through APEX or Transformer Engine. Ours has it in PyTorch (model/layers/wgrad.py), so
            # Megatron-Bridge's default (on, where the model has DDP's main_grad) applies, as on skyrl-train 0.3.1
            self.transformer_config_kwargs.pop(_WGRAD_FUSION, None)
        # a `ddp_config.<key>=...` override arrives as a mapping of that key alone: keep the other defaults
        self.ddp_config = {**copy.deepcopy(ddp_defaults), **(self.ddp_config or {})}

    return dataclasses.make_dataclass(
        "MegatronSettings", extra, bases=(MegatronConfig,), namespace={"__post_init__": __post_init__}
    )


MegatronSettings = _megatron_settings_class()


@dataclass
class MegatronPolicyConfig(PolicyConfig):
    megatron_config: MegatronSettings = field(default_factory=MegatronSettings)  # type: ignore[valid-type]


@dataclass
class MegatronRefConfig(RefConfig):
    megatron_config: MegatronSettings = field(default_factory=MegatronSettings)  # type: ignore[valid-type]


@dataclass
class MegatronCriticConfig(CriticConfig):
    megatron_config: MegatronSettings = field(default_factory=MegatronSettings)  # type: ignore[valid-type]


@dataclass
class MegatronTrainerConfig(TrainerConfig):
    # as the `skyrl-megatron` command's primary config has them on skyrl-train 0.3.1 (the host defaults
    # to fsdp and to wandb, which needs an account and WANDB_API_KEY)
    strategy: str = "megatron"
    logger: str = "console"
    preemption_signal: Optional[str] = "SIGTERM"
    """This signal to the driver makes the run finish its step, save a checkpoint and exit with code 75
    (``exit_codes.PREEMPTED``); a second one ends it at once. null: signals keep their default action
    (the same key as on skyrl-train 0.3.1)."""
    policy: MegatronPolicyConfig = field(default_factory=MegatronPolicyConfig)
    ref: MegatronRefConfig = field(default_factory=MegatronRefConfig)
    critic: MegatronCriticConfig = field(default_factory=MegatronCriticConfig)


@dataclass
class MegatronGeneratorConfig(GeneratorConfig):
    engine: str = "auto"
    """auto: the host's engines (vLLM servers) | cpu / gpu: skyrl-megatron's HF engine on CPU or on a GPU
    of its own, for machines without vLLM (the same key as on skyrl-train 0.3.1)."""


@dataclass
class SkyRLMegatronConfig(SkyRLTrainConfig):
    """``SkyRLTrainConfig`` with skyrl-megatron's keys under ``trainer.<role>.megatron_config`` and
    ``generator.engine``."""

    trainer: MegatronTrainerConfig = field(default_factory=MegatronTrainerConfig)
    generator: MegatronGeneratorConfig = field(default_factory=MegatronGeneratorConfig)

    def __post_init__(self) -> None:
        _settle_engine_routes(self)
        _settle_token_budget(self)
        super().__post_init__()


class SkyRLMegatronLightConfig(SkyRLMegatronConfig):
    """The same strict parse of the same overrides, without the host's own root ``__post_init__``.

    That one imports torch (for its LoRA weight-sync rule, through
    ``skyrl.backends.skyrl_train.inference_servers.utils``: about 4 s) and otherwise fills in or checks
    host fields that our checks do not read. Our checks run on this first, so a bad value of ours is
    reported before torch loads; nothing runs with it (the full parse follows).
    """

    def __post_init__(self) -> None:
        _settle_engine_routes(self)
        _settle_token_budget(self)


def _settle_token_budget(cfg: SkyRLMegatronConfig) -> None:
    """skyrl 0.4's own Megatron and FSDP workers pack micro-batches by ``trainer.max_tokens_per_microbatch``
    (-1: off). A user coming from them sets that key; ours is per role
    (``trainer.<role>.megatron_config.max_tokens_per_microbatch``). The host's value fills each role
    that leaves ours unset; a role's own value wins (e.g. a larger budget for the reference)."""
    if cfg.trainer.strategy != "megatron" or (cfg.trainer.max_tokens_per_microbatch or -1) <= 0:
        return
    for role in ("policy", "ref", "critic"):
        megatron = getattr(cfg.trainer, role).megatron_config
        if megatron.max_tokens_per_microbatch is None:
            megatron.max_tokens_per_microbatch = cfg.trainer.max_tokens_per_microbatch


def _settle_engine_routes(cfg: SkyRLMegatronConfig) -> None:
    """Routing replay from the engines' routes (R3) has two spellings: ours
    (``policy.megatron_config.moe_config.routing_replay=r3``) and the host's (``moe_enable_routing_replay``
    with ``generator.inference_engine.enable_return_routed_experts``). Either one sets the other's keys:
    the host's generator asks its engines for routes only under its flag, and its checks want both."""
    if cfg.trainer.strategy != "megatron":
        return
    megatron = cfg.trainer.policy.megatron_config
    engine = cfg.generator.inference_engine
    moe = megatron.moe_config if isinstance(megatron.moe_config, dict) else None
    if moe is None:
        return
    if moe.get("routing_replay") == "r3":
        engine.enable_return_routed_experts = True
        megatron.moe_enable_routing_replay = True
    elif megatron.moe_enable_routing_replay and engine.enable_return_routed_experts and moe.get("routing_replay") is None:
        moe["routing_replay"] = "r3"
