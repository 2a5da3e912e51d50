"""Typed view of the ``megatron_config`` group and up-front validation.

Imports nothing heavy (no torch, no Megatron): a bad config is reported in about a second.

The YAML lives in ``config/megatron/{policy,ref,critic}.yaml`` and is composed into the host's config
at ``trainer.<role>.megatron_config``. :func:`check_config` runs before Ray or any model is
touched, collects every problem it finds, and raises one :class:`ConfigError` whose lines each name
the key, what is wrong, and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from skyrl_megatron.attention_kernels import ATTENTION_KERNELS, FLASH4_INSTALL_FIX, SegmentKernel, flash4_installed
from skyrl_megatron.lora_spec import LORA_TYPES, WEIGHT_SYNC_MODES, LoraConfigError, LoraSpec
from skyrl_megatron.megatron_fields import section_fields

if TYPE_CHECKING:
    from skyrl_megatron.parallel import ParallelConfig

ROLES = ("policy", "ref", "critic")
KNOWN_STRATEGIES = ("fsdp", "fsdp2", "deepspeed", "megatron")


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        fix = self.fix if self.fix.endswith((".", "?", "!")) else self.fix + "."
        return f"{self.key}: {self.message}. Fix: {fix}"


class ConfigError(ValueError):
    """Every problem found in a config, reported together."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        count = len(self.problems)
        head = "invalid skyrl-megatron config" + (f" ({count} problems)" if count > 1 else "")
        return head + ": " + " ".join(str(p) for p in self.problems)


def closest(name: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    suggestion = closest(name, candidates)
    return f"did you mean '{suggestion}'?" if suggestion else "remove it"


# ----------------------------------------------------------------------------------------------
# Typed config
# ----------------------------------------------------------------------------------------------

# fused kernels for the TE-free layers and the logprob head (skyrl_megatron/model/layers/fusions.py),
# and those on by default: `rms_norm` (the block's norms on quack-kernels' RMSNorm where installed, else our
# Triton kernels) stays opt-in: less device time than PyTorch's fused norm but more host time per call, within
# 2.5% of the defaults end to end (H200, 2026-12-06); qk_norm_rope took 3% off a Qwen3-4B training step
# (2026-11-27); `lse_gemm` (the logprob head's log-sum-exp and label logit in quack-kernels' GEMM epilogue, from the
# fp32 accumulator, where quack runs; compute/logprob_gemm.py) took 4-8% off the scoring passes on an H100
# (2026-12-06); `swiglu_gemm` (the dense MLP's fc1 with the SwiGLU in quack-kernels' GEMM epilogue in forward-only
# passes, where quack runs; model/layers/mlp.py) ran fc1 and the activation in 12-16% less time than cuBLAS's GEMM
# and our SwiGLU kernel at Qwen3-1.7B's and 4B's widths on an H100 (2026-12-07), 1.7B scoring +6.5-7.1% end to end;
# `swiglu_gemm_training` (opt-in: the dense MLP's gated GEMM in training passes too, the SwiGLU's backward in fc2's
# input-gradient GEMM: 2.5 GiB less training peak at 1.7B, its kernels 4-5% slower than Megatron's path, H100,
# 2026-12-07); `swiglu_gemm_experts` (opt-in: the grouped MoE experts' fc1 with the SwiGLU in quack's gated
# varying-M GEMM in forward-only passes: 14% slower than the two kernels at Qwen3-30B-A3B's widths, H100,
# 2026-12-07). The MoE experts' GEMMs are `moe_config.expert_gemms`.
FUSED_KERNELS: tuple[str, ...] = ("rms_norm", "rope", "qk_norm_rope", "swiglu", "swiglu_gemm", "swiglu_gemm_training",
                                  "swiglu_gemm_experts", "logprobs", "lse_gemm")
DEFAULT_FUSED_KERNELS: tuple[str, ...] = ("rope", "qk_norm_rope", "swiglu", "swiglu_gemm", "logprobs", "lse_gemm")
# names `fused_kernels` took before the experts' GEMMs got their own key
_EXPERT_GEMM_KERNELS = ("expert_gemm", "expert_wgrad")
AUTO = "auto"


@dataclass
class LoraSettings:
    """``megatron_config.lora_config``; rank, alpha, dropout and targets are the host's ``model.lora`` keys."""

    lora_type: str = "lora"  # "lora" | "canonical_lora" (Megatron-Bridge PEFT)
    weight_sync: str = "merged"  # "merged": base + BA under HF names | "adapters": a PEFT adapter directory


# what each activation-recompute granularity leaves out of Megatron's TransformerConfig
_RECOMPUTE_COMPANIONS = {
    None: ("recompute_method", "recompute_num_layers", "recompute_modules"),
    "selective": ("recompute_method", "recompute_num_layers"),
}

# moe_config values; skyrl_megatron/model/moe/settings.py maps them onto Megatron's TransformerConfig

TOKEN_DISPATCHERS = ("alltoall", "allgather", "flex")
FLEX_BACKENDS = ("deepep", "hybridep")
ROUTER_DTYPES = ("fp32", "fp64")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
# r2: the policy's scoring pass records routes, training replays them; r3: the inference engine's routes
ROUTING_REPLAYS = ("r2", "r3")
# the grouped experts' GEMMs (model/quack_support.py `experts_on_quack`): auto takes quack-kernels' varlen GEMMs
# on a Hopper or later GPU where quack imports, else torch._grouped_mm; quack refuses to start without them
EXPERT_GEMMS = ("auto", "quack", "torch")


@dataclass
class MoeSettings:
    """``megatron_config.moe_config``: routing and token dispatch of MoE models; ignored for dense ones.

    The defaults suit RL fine-tuning: no load-balancing loss and a frozen expert bias, since both
    pull routing towards balance rather than towards the reward (and are computed over padding).
    """

    token_dispatcher: str = "alltoall"  # alltoall | allgather | flex
    flex_backend: str = "deepep"  # deepep | hybridep (with token_dispatcher=flex)
    router_dtype: str | None = "fp32"  # fp32 | fp64 | null (the model's dtype)
    load_balancing_type: str | None = None  # null: the checkpoint's (as the bridge sets it)
    aux_loss_coeff: float = 0.0
    freeze_router: bool = False
    expert_bias: bool | None = None  # null: the checkpoint's; true/false must match it
    expert_bias_update_rate: float = 0.0
    routing_replay: str | None = None  # null | r2 | r3 (compute/route_replay.py); the policy's only
    # EP > 1: all-to-alls with the split sizes on the device (torch's NVSHMEM op; model/moe/exchange_dispatcher.py)
    device_all_to_all: bool = False
    # EP > 1: each MoE layer's tokens in two halves, one half's all-to-all under the other's experts
    # (model/moe/split_overlap.py)
    overlap_all_to_all: bool = False
    # the grouped experts' GEMMs: auto | quack | torch (EXPERT_GEMMS)
    expert_gemms: str = "auto"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], prefix: str = "megatron_config.moe_config") -> "MoeSettings":
        unknown = [k for k in data if k not in cls.field_names()]
        if unknown:
            raise ConfigError(Problem(f"{prefix}.{k}", "unknown key", _did_you_mean(k, cls.field_names())) for k in unknown)
        return cls(**data)

    def problems(self, prefix: str) -> list[Problem]:
        """Bad values, each naming its key (availability of the flex backend is checked separately)."""
        found = []

        def one_of(key: str, value, allowed: tuple, nullable: bool = False) -> None:
            if value in allowed or (nullable and value is None):
                return
            hint = closest(str(value), allowed)
            fix = f"use one of {', '.join(allowed)}" + (" or null" if nullable else "")
            found.append(Problem(f"{prefix}.{key}", f"unknown value {value!r}", fix + (f" (did you mean '{hint}'?)" if hint else "")))

        def non_negative(key: str, value) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                found.append(Problem(f"{prefix}.{key}", f"must be a number >= 0, got {value!r}", "set 0 to turn it off"))

        def boolean(key: str, value, nullable: bool = False) -> None:
            if not isinstance(value, bool) and not (nullable and value is None):
                found.append(Problem(f"{prefix}.{key}", f"must be true or false{' or null' if nullable else ''}, got {value!r}", "set true or false"))

        one_of("token_dispatcher", self.token_dispatcher, TOKEN_DISPATCHERS)
        one_of("flex_backend", self.flex_backend, FLEX_BACKENDS)
        one_of("router_dtype", self.router_dtype, ROUTER_DTYPES, nullable=True)
        one_of("load_balancing_type", self.load_balancing_type, LOAD_BALANCING_TYPES, nullable=True)
        non_negative("aux_loss_coeff", self.aux_loss_coeff)
        non_negative("expert_bias_update_rate", self.expert_bias_update_rate)
        boolean("freeze_router", self.freeze_router)
        boolean("expert_bias", self.expert_bias, nullable=True)
        one_of("routing_replay", self.routing_replay, ROUTING_REPLAYS, nullable=True)
        boolean("device_all_to_all", self.device_all_to_all)
        if self.device_all_to_all is True and self.token_dispatcher != "alltoall":
            found.append(Problem(f"{prefix}.device_all_to_all", f"it replaces the alltoall dispatcher's exchange, and "
                                 f"token_dispatcher is {self.token_dispatcher!r}", "set token_dispatcher=alltoall, or device_all_to_all=false"))
        boolean("overlap_all_to_all", self.overlap_all_to_all)
        one_of("expert_gemms", self.expert_gemms, EXPERT_GEMMS)
        if self.overlap_all_to_all is True and self.token_dispatcher != "alltoall":
            found.append(Problem(f"{prefix}.overlap_all_to_all", f"it runs the alltoall dispatcher's exchange in two "
                                 f"halves, and token_dispatcher is {self.token_dispatcher!r}",
                                 "set token_dispatcher=alltoall, or overlap_all_to_all=false"))
        if self.overlap_all_to_all is True and self.device_all_to_all is True:
            found.append(Problem(f"{prefix}.overlap_all_to_all", "it runs Megatron's all-to-all in two halves, which "
                                 "device_all_to_all replaces", "set device_all_to_all=false, or overlap_all_to_all=false"))
        if self.routing_replay is not None and self.load_balancing_type in ("sinkhorn", "quantile_balancing"):
            found.append(
                Problem(
                    f"{prefix}.routing_replay",
                    f"{self.load_balancing_type!r} routing does not choose experts by top-k, so there is no choice to replay",
                    "use a top-k load_balancing_type (aux_loss, seq_aux_loss, global_aux_loss, none) or routing_replay=null",
                )
            )
        if self.load_balancing_type in ("sinkhorn", "quantile_balancing", "none") and _positive(self.aux_loss_coeff):
            found.append(
                Problem(
                    f"{prefix}.aux_loss_coeff",
                    f"an auxiliary loss ({self.aux_loss_coeff}) needs an aux-loss load-balancing type, not {self.load_balancing_type!r}",
                    "set load_balancing_type to aux_loss, seq_aux_loss or global_aux_loss, or aux_loss_coeff=0",
                )
            )
        return found


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# Scoring keeps no activations for backward, so by default it packs this many times the training budget:
# on an H200 (measured 2026-11-27) 4 x 8192 tokens (with 1 GiB logits chunks) scored Qwen3-1.7B 1.55x and Qwen3-4B
# 1.1x faster than 8192 tokens (256 MiB chunks), for 1.3-1.8 GiB more at the scoring peak (docs/benchmarks.md)
SCORING_BUDGET_FACTOR = 4

# `collective_timeout_s` default: a collective of a steady-state call that waits this long has a peer that
# died or skipped it (torch's own default is 30 minutes, during which the job holds its GPUs doing nothing)
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# signals that make the driver finish its step, save a checkpoint and exit (`trainer.preemption_signal`)
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@dataclass
class MegatronWorkerConfig:
    """``trainer.<role>.megatron_config`` as a dataclass. Field names are the YAML keys."""

    runtime: str = "auto"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = True
    max_tokens_per_microbatch: int | None = None
    # scoring passes' token budget (they keep no activations for backward); None: SCORING_BUDGET_FACTOR x
    # max_tokens_per_microbatch (or rows, as the host splits them, where that is None too)
    forward_max_tokens_per_microbatch: int | None = None
    checkpoint_cache_dir: str | None = None
    force_reconvert: bool = False
    # give the CUDA allocator's free blocks back after offloading, and between passes where the placement
    # shares the worker's GPUs with another model or the engines (the host asks after every pass; on GPUs of
    # its own the pool is kept: nothing else could take it); false: keep it always (refused where shared).
    # The host's own key (its default, true, wins the merge): so no "auto" here.
    empty_cuda_cache: bool = True
    # Python's long-lived objects frozen out of the cyclic collector, which waits for each pass to end
    manual_gc: bool = True
    # colocated on a GPU: the optimizer's state back on a CUDA stream of its own, beside the first forward and
    # backward (workers/offload.py, arrivals.py); its first reader waits for it
    overlap_optimizer_backload: bool = False
    # the logprob head's fp32 logits per chunk of tokens (compute/logprobs.py)
    logits_chunk_mib: int = 1024
    # the logprob head's logits (bf16) a training forward keeps per micro-batch for its backward, in whole
    # chunks, instead of recomputing them (one of the head's four GEMMs); 0: always recompute
    logits_kept_mib: int = 4096
    fused_kernels: list[str] = field(default_factory=lambda: list(DEFAULT_FUSED_KERNELS))
    attention_kernel: str = "auto"  # auto | flash4 | varlen | sdpa (attention_kernels.py)
    # fp32 master weights kept as bf16 weight + int16 remainder between optimizer steps (master_weights.py);
    # auto: wherever the optimizer allows it (optim.OptimizerSettings.build_optimizer), true: there or an error
    compact_master_weights: bool | str = AUTO
    # AdamW straight on the compact masters (compact_adam.py): each run of released masters stepped by one Triton
    # pass (28 bytes a parameter) in place of their rebuild, torch's fused AdamW and their release (44-48); auto:
    # wherever the compact masters run on fp32 gradients (ddp_config.grad_reduce_in_fp32), true: there or an error
    compact_adam: bool | str = AUTO
    ddp_config: dict[str, Any] = field(default_factory=dict)
    optimizer_config_kwargs: dict[str, Any] = field(default_factory=dict)
    transformer_config_kwargs: dict[str, Any] = field(default_factory=dict)
    model_config_kwargs: dict[str, Any] = field(default_factory=dict)
    lora_config: LoraSettings = field(default_factory=LoraSettings)
    moe_config: MoeSettings = field(default_factory=MoeSettings)
    torch_profiler_config: dict[str, Any] = field(default_factory=dict)
    # checkpoints written in the background: the state is staged in host memory and training goes on
    # (checkpoint/async_save.py); the save is published (and made the latest) once complete
    async_save: bool = False
    # how long a rank waits in a collective of a scoring, training or sync call before the call fails
    # with an error naming the ranks that did not join (watchdog.py); start-up and checkpoints keep
    # torch's 30 minutes (conversion, large reads and writes)
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "MegatronWorkerConfig":
        unknown = [k for k in data if k not in cls.field_names()]
        if unknown:
            raise ConfigError(
                Problem(f"megatron_config.{k}", "unknown key", _did_you_mean(k, cls.field_names())) for k in unknown
            )
        values = dict(data)
        if isinstance(values.get("lora_config"), Mapping):
            values["lora_config"] = LoraSettings(**values["lora_config"])
        if isinstance(values.get("moe_config"), Mapping):
            values["moe_config"] = MoeSettings.from_mapping(values["moe_config"])
        return cls(**values)

    @classmethod
    def from_host_config(cls, cfg, role: str) -> "MegatronWorkerConfig":
        from omegaconf import OmegaConf

        node = cfg.trainer[role].get("megatron_config")
        data = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        return cls.from_mapping(data)

    def parallel(self) -> ParallelConfig:
        from skyrl_megatron.parallel import ParallelConfig  # torch: only where a worker builds groups

        return ParallelConfig(
            tensor=self.tensor_model_parallel_size,
            pipeline=self.pipeline_model_parallel_size,
            virtual_pipeline=self.virtual_pipeline_model_parallel_size,
            context=self.context_parallel_size,
            expert=self.expert_model_parallel_size,
            expert_tensor=self.expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel and self.tensor_model_parallel_size > 1,
        )

    def transformer_overrides(self) -> dict[str, Any]:
        """Pass-through kwargs for TransformerConfig; null means "keep Megatron's default".

        Recompute's companions count only with the granularity they belong to: skyrl 0.4's default dict (full
        recompute, `uniform` over 1 layer) merges them into a user's `recompute_granularity=selective` or `=null`,
        which Megatron would refuse (selective) or carry unused (null)."""
        kwargs = {k: v for k, v in self.transformer_config_kwargs.items() if v is not None}
        granularity = kwargs.get("recompute_granularity")
        for key in _RECOMPUTE_COMPANIONS.get(granularity, ()):
            kwargs.pop(key, None)
        return kwargs


# ----------------------------------------------------------------------------------------------
# The model's shape, read from its HF config.json (cheap: no weights, no transformers import)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int | None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
        return cls(
            model_type=str(config.get("model_type", "unknown")),
            num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(text.get("num_key_value_heads") or heads),
            num_experts=int(experts) if experts else None,
        )


def _is_local_path(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path)


def read_model_shape(path: str) -> ModelShape | None:
    """The shape of a local HF checkpoint, or None for a hub id that is not cached locally."""
    local = Path(os.path.expanduser(path))
    config_file = local / "config.json"
    if not config_file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a valid repo id
            cached = None
        if not isinstance(cached, str):
            return None
        config_file = Path(cached)
    return ModelShape.from_hf_config(json.loads(config_file.read_text()))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def active_roles(cfg) -> list[str]:
    """The worker roles the host trainer will build for this config."""
    roles = ["policy"]
    algorithm = cfg.trainer.algorithm
    if algorithm.get("use_kl_loss") or algorithm.get("use_kl_in_reward"):
        roles.append("ref")
    if cfg.trainer.critic.model.get("path"):
        roles.append("critic")
    return roles


def role_world_size(cfg, role: str) -> int:
    placement = cfg.trainer.placement
    return int(placement[f"{role}_num_nodes"]) * int(placement[f"{role}_num_gpus_per_node"])


def _model_path(cfg, role: str) -> str | None:
    return cfg.trainer[role].model.get("path")


def check_strategy(cfg) -> list[Problem]:
    strategy = cfg.trainer.get("strategy")
    if strategy in KNOWN_STRATEGIES:
        return []
    return [
        Problem(
            "trainer.strategy",
            f"unknown strategy {strategy!r}",
            f"use one of {', '.join(KNOWN_STRATEGIES)}" + (f" (did you mean '{closest(str(strategy), KNOWN_STRATEGIES)}'?)" if closest(str(strategy), KNOWN_STRATEGIES) else ""),
        )
    ]


def check_critic(cfg) -> list[Problem]:
    """What the Megatron critic worker needs beyond its `megatron_config` (checked like every role's).

    Its layout, sizes and model are checked by `check_megatron_role`; the critic's mini-batch against
    its DP size by the host's own rules (the 0.3.1 adapter's `validate` gives them our DP size).
    """
    critic = cfg.trainer.critic
    if cfg.trainer.strategy != "megatron" or not critic.model.get("path"):
        return []
    problems = []
    lora = critic.model.get("lora") or {}
    if int(lora.get("rank") or 0) > 0:
        problems.append(
            Problem(
                "trainer.critic.model.lora.rank",
                "LoRA on the Megatron critic is not supported (the value head is new and must train with the trunk)",
                "set trainer.critic.model.lora.rank=0; the critic trains all its weights",
            )
        )
    if int(critic.get("sequence_parallel_size") or 1) != 1:
        problems.append(
            Problem(
                "trainer.critic.sequence_parallel_size",
                f"Ulysses sequence parallelism ({critic.sequence_parallel_size}) is the FSDP workers'; a Megatron "
                "critic splits sequences by context parallelism",
                "set trainer.critic.sequence_parallel_size=1 and, for long sequences, "
                "trainer.critic.megatron_config.context_parallel_size",
            )
        )
    value_clip = cfg.trainer.algorithm.get("value_clip")
    if value_clip is not None and (isinstance(value_clip, bool) or not isinstance(value_clip, (int, float)) or value_clip <= 0):
        problems.append(
            Problem(
                "trainer.algorithm.value_clip",
                f"must be a positive number or null, got {value_clip!r}",
                "set e.g. 0.2 (values move at most that far from the old ones per update), or null to turn clipping off",
            )
        )
    return problems


def megatron_dp_divisor(cfg, role: str) -> int:
    """TP * PP * CP of a role's `megatron_config`: its world size over this is its DP size."""
    node = cfg.trainer[role].get("megatron_config") or {}
    sizes = [node.get(key, 1) or 1 for key in
             ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")]
    return int(sizes[0]) * int(sizes[1]) * int(sizes[2])


def check_model_paths(cfg) -> list[Problem]:
    problems = []
    reported: set[str] = set()
    for role in active_roles(cfg):
        key = f"trainer.{role}.model.path"
        path = _model_path(cfg, role)
        if path in reported:  # e.g. the ref's path interpolates the policy's
            continue
        reported.add(path)
        if not path:
            problems.append(Problem(key, "no model path is set", f"set {key}=<HF checkpoint dir or hub id>"))
        elif _is_local_path(path) and not (Path(os.path.expanduser(path)) / "config.json").is_file():
            what = "does not exist" if not Path(os.path.expanduser(path)).exists() else "has no config.json"
            problems.append(
                Problem(key, f"{path!r} {what}", f"point {key} at a Hugging Face checkpoint directory")
            )
    return problems


def _recompute_problems(prefix: str, kwargs: Mapping[str, Any]) -> list[Problem]:
    """Activation recompute as Megatron's TransformerConfig will take it, named before any model is built."""
    granularity = kwargs.get("recompute_granularity")
    if granularity is None:
        return []
    if granularity not in ("full", "selective"):
        return [Problem(f"{prefix}.recompute_granularity", f"must be full, selective or null, got {granularity!r}",
                        "set full (whole layers), selective (with recompute_modules) or null (off)")]
    if granularity == "selective":
        return []
    problems = []
    if kwargs.get("recompute_method") not in ("uniform", "block"):
        problems.append(Problem(f"{prefix}.recompute_method",
                                f"full recompute needs uniform or block, got {kwargs.get('recompute_method')!r}",
                                "set recompute_method=uniform (every N layers) or block (the first N of each stage)"))
    layers = kwargs.get("recompute_num_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        problems.append(Problem(f"{prefix}.recompute_num_layers",
                                f"full recompute needs a positive number of layers, got {layers!r}",
                                "set recompute_num_layers=1 (uniform: recompute every layer)"))
    return problems


def check_megatron_role(cfg, role: str, shape: ModelShape | None) -> list[Problem]:
    prefix = f"trainer.{role}.megatron_config"
    node = cfg.trainer[role].get("megatron_config")
    if node is None:
        return [Problem(prefix, "missing", "compose the config through `skyrl-megatron` (it adds the megatron group)")]
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(node, resolve=True)
    problems: list[Problem] = []
    known = MegatronWorkerConfig.field_names()
    for key in data:
        if key not in known:
            problems.append(Problem(f"{prefix}.{key}", "unknown key", _did_you_mean(key, known)))
    for section, (cls_name, fields) in section_fields().items():
        for key in data.get(section) or {}:
            if key not in fields:
                problems.append(
                    Problem(
                        f"{prefix}.{section}.{key}",
                        f"not a field of Megatron's {cls_name}",
                        _did_you_mean(key, fields),
                    )
                )
    moe_section = data.get("moe_config") or {}
    if not isinstance(moe_section, Mapping):
        fix = "set its keys, e.g. moe_config.token_dispatcher=alltoall"
        problems.append(Problem(f"{prefix}.moe_config", f"must be a mapping, got {moe_section!r}", fix))
        moe_section = {}
    for key in moe_section:
        if key not in MoeSettings.field_names():
            problems.append(Problem(f"{prefix}.moe_config.{key}", "unknown key", _did_you_mean(key, MoeSettings.field_names())))
    if problems:
        return problems  # the sizes below may be meaningless when keys are misspelt

    mc = MegatronWorkerConfig.from_mapping(data)
    tp, pp, cp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size
    ep, etp, vpp = mc.expert_model_parallel_size, mc.expert_tensor_parallel_size, mc.virtual_pipeline_model_parallel_size
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
    ):
        if not isinstance(value, int) or value < 1:
            problems.append(Problem(f"{prefix}.{name}", f"must be a positive integer, got {value!r}", "set it to 1 or more"))
    if isinstance(mc.logits_chunk_mib, bool) or not isinstance(mc.logits_chunk_mib, int) or mc.logits_chunk_mib < 1:
        problems.append(Problem(f"{prefix}.logits_chunk_mib", f"must be a positive integer, got {mc.logits_chunk_mib!r}",
                                "set the MiB of fp32 logits per chunk, e.g. 256"))
    if isinstance(mc.logits_kept_mib, bool) or not isinstance(mc.logits_kept_mib, int) or mc.logits_kept_mib < 0:
        problems.append(Problem(f"{prefix}.logits_kept_mib", f"must be a non-negative integer, got {mc.logits_kept_mib!r}",
                                "set the MiB of logits kept for the backward, or 0 to recompute them"))
    for name in ("empty_cuda_cache", "force_reconvert", "manual_gc", "async_save", "overlap_optimizer_backload"):
        if not isinstance(getattr(mc, name), bool):
            problems.append(Problem(f"{prefix}.{name}", f"must be true or false, got {getattr(mc, name)!r}", "set true or false"))
    problems += _fault_handling_problems(role, prefix, mc)
    if problems:
        return problems
    sharing = gpu_sharing(cfg, role)
    if mc.empty_cuda_cache is False and sharing:
        problems.append(Problem(f"{prefix}.empty_cuda_cache",
                                f"false keeps this worker's CUDA cache while {sharing} shares its GPUs",
                                "set it true, or give the models and engines GPUs of their own"))

    world = role_world_size(cfg, role)
    placement = f"trainer.placement.{role}_num_nodes * {role}_num_gpus_per_node"
    if world % (tp * pp * cp):
        problems.append(
            Problem(
                f"{prefix}.tensor/pipeline/context_parallel_size",
                f"{role} world size {world} ({placement}) is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}",
                f"choose sizes whose product divides {world}, or change {placement}",
            )
        )
    expert_tp = etp if etp is not None else tp
    if (ep > 1 or etp is not None) and world % (expert_tp * ep * pp):
        problems.append(
            Problem(
                f"{prefix}.expert_model_parallel_size",
                f"{role} world size {world} is not divisible by ETP*EP*PP = {expert_tp}*{ep}*{pp}",
                "choose expert_model_parallel_size (and expert_tensor_parallel_size) so that the product divides the world size",
            )
        )
    if vpp is not None:
        if vpp < 1:
            problems.append(Problem(f"{prefix}.virtual_pipeline_model_parallel_size", f"must be >= 1 or null, got {vpp}", "set null to disable interleaving"))
        elif vpp > 1 and pp == 1:
            problems.append(
                Problem(
                    f"{prefix}.virtual_pipeline_model_parallel_size",
                    f"virtual pipeline stages ({vpp}) need pipeline_model_parallel_size > 1",
                    "set pipeline_model_parallel_size >= 2 or virtual_pipeline_model_parallel_size=null",
                )
            )
    if cp > 1 and not cfg.trainer.get("use_sample_packing", False):
        problems.append(
            Problem(
                f"{prefix}.context_parallel_size",
                f"context parallelism ({cp}) splits packed sequences and needs sample packing",
                "set trainer.use_sample_packing=true or context_parallel_size=1",
            )
        )
    if mc.runtime not in ("auto", "cuda", "cpu"):
        problems.append(Problem(f"{prefix}.runtime", f"unknown runtime {mc.runtime!r}", "use auto, cuda or cpu"))
    problems += _recompute_problems(f"{prefix}.transformer_config_kwargs", mc.transformer_overrides())
    problems += check_lora(cfg, role, mc, shape)
    problems += mc.moe_config.problems(f"{prefix}.moe_config")
    if shape is None or shape.num_experts:  # a dense model ignores moe_config
        problems += _moe_backend_problems(f"{prefix}.moe_config", mc.moe_config)
        problems += _routing_replay_problems(cfg, role, prefix, mc)
        problems += _device_all_to_all_problems(cfg, role, prefix, mc)
        problems += _split_overlap_problems(cfg, role, prefix, mc)
    elif mc.moe_config.routing_replay == "r3":  # (it would have the engines return routes they do not have)
        problems.append(Problem(f"{prefix}.moe_config.routing_replay", f"r3 replays MoE routes, but {shape.model_type} "
                                "at the model path has no experts", "set routing_replay=null for a dense model"))
    problems += _compact_master_weight_problems(cfg, role, prefix, mc)
    problems += _compact_adam_problems(role, prefix, mc)
    problems += _fused_kernel_problems(f"{prefix}.fused_kernels", mc.fused_kernels)
    problems += _attention_kernel_problems(f"{prefix}.attention_kernel", mc.attention_kernel, mc.runtime)
    if mc.max_tokens_per_microbatch is not None and mc.max_tokens_per_microbatch < 1:
        problems.append(Problem(f"{prefix}.max_tokens_per_microbatch", "must be positive or null", "set a token budget such as 8192, or null to split by count"))
    forward_budget = mc.forward_max_tokens_per_microbatch
    if forward_budget is not None and (isinstance(forward_budget, bool) or not isinstance(forward_budget, int) or forward_budget < 1):
        problems.append(Problem(f"{prefix}.forward_max_tokens_per_microbatch", f"must be a positive integer or null, got {forward_budget!r}",
                                "set the scoring passes' token budget, e.g. 32768, or null to use max_tokens_per_microbatch"))

    if shape is not None:
        problems += _check_against_model(prefix, shape, tp, pp, vpp, ep)
    return problems


def _fault_handling_problems(role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """`async_save` (a trained role's checkpoints) and `collective_timeout_s` (every role's collectives)."""
    problems = []
    timeout = mc.collective_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(Problem(f"{prefix}.collective_timeout_s", f"must be a number of seconds > 0, got {timeout!r}",
                                f"set e.g. {DEFAULT_COLLECTIVE_TIMEOUT_S:g} (a collective that waits longer fails, naming the "
                                "ranks that did not join it)"))
    if role == "ref" and mc.async_save is True:
        problems.append(Problem(f"{prefix}.async_save", "the reference model saves no checkpoints",
                                "set trainer.policy.megatron_config.async_save (and the critic's) instead, and false here"))
    return problems


def check_preemption_signal(cfg) -> list[Problem]:
    """`trainer.preemption_signal`: the signal that makes the driver save a checkpoint and exit (null: none)."""
    value = cfg.trainer.get("preemption_signal")
    if value is None or value in PREEMPTION_SIGNALS:
        return []
    hint = closest(str(value).upper(), PREEMPTION_SIGNALS)
    return [Problem("trainer.preemption_signal", f"unknown signal {value!r}",
                    f"use one of {', '.join(PREEMPTION_SIGNALS)}, or null to leave signals alone"
                    + (f" (did you mean '{hint}'?)" if hint else ""))]


def _compact_master_weight_problems(cfg, role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """Where `compact_master_weights` applies: the distributed optimizer's fp32 masters of bf16
    parameters under torch's Adam (the layouts master_weights.refusal accepts at build time)."""
    key = f"{prefix}.compact_master_weights"
    value = mc.compact_master_weights
    if not (isinstance(value, bool) or value == AUTO):
        return [Problem(key, f"must be true, false or auto, got {value!r}",
                        "set auto (wherever the optimizer allows it), true or false")]
    if value is not True:  # auto settles quietly on what the built optimizer allows
        return []
    off = "set compact_master_weights=false"
    if role == "ref":
        return [Problem(key, "the reference model has no optimizer", off)]
    problems = []
    ddp, optim = mc.ddp_config or {}, mc.optimizer_config_kwargs or {}
    if not ddp.get("use_distributed_optimizer", False):
        problems.append(Problem(key, "needs Megatron's distributed optimizer", f"set {prefix}.ddp_config.use_distributed_optimizer=true, or {off}"))
    if not cfg.trainer.get("bf16", True) or optim.get("fp16"):
        problems.append(Problem(key, "needs bf16 parameters (fp16 and fp32 parameters keep no bf16 copy of the masters)", f"set trainer.bf16=true, or {off}"))
    if optim.get("optimizer", "adam") != "adam":
        problems.append(Problem(key, f"needs the Adam optimizer, got optimizer_config_kwargs.optimizer={optim['optimizer']!r}", off))
    for name in ("use_precision_aware_optimizer", "optimizer_cpu_offload"):
        if optim.get(name):
            problems.append(Problem(key, f"optimizer_config_kwargs.{name} keeps its own master weights", f"set {name}=false, or {off}"))
    for name in ("use_megatron_fsdp", "fp8_param_gather", "fp4_param_gather"):
        if ddp.get(name):
            problems.append(Problem(key, f"not supported with ddp_config.{name}", f"set {name}=false, or {off}"))
    return problems


def _compact_adam_problems(role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """Where `compact_adam` can step the masters: compact ones, fed fp32 gradients, of a role with an optimizer
    (the rest of what it needs is what `compact_master_weights` needs, checked there)."""
    key, value = f"{prefix}.compact_adam", mc.compact_adam
    if not (isinstance(value, bool) or value == AUTO):
        return [Problem(key, f"must be true, false or auto, got {value!r}",
                        "set auto (wherever the compact masters run on fp32 gradients), true or false")]
    if value is not True:  # auto settles quietly on what the built optimizer allows
        return []
    off = "set compact_adam=false (or auto)"
    if role == "ref":
        return [Problem(key, "the reference model has no optimizer", off)]
    problems = []
    if mc.compact_master_weights is False:
        problems.append(Problem(key, "steps compact master weights, which are off",
                                f"set {prefix}.compact_master_weights=auto (or true), or {off}"))
    if not (mc.ddp_config or {}).get("grad_reduce_in_fp32", False):
        problems.append(Problem(key, "reads fp32 gradients", f"set {prefix}.ddp_config.grad_reduce_in_fp32=true, or {off}"))
    return problems


def _routing_replay_problems(cfg, role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """Where `moe_config.routing_replay` can work: the policy, routers through the top-k hook, and
    for r3 an inference engine that returns its routes through the host."""
    replay = mc.moe_config.routing_replay
    key = f"{prefix}.moe_config.routing_replay"
    if replay is None:
        return []
    if role != "policy":
        return [Problem(key, f"routing replay is for the policy's scoring and training passes; the {role} model only scores",
                        "set trainer.policy.megatron_config.moe_config.routing_replay instead, and null here")]
    problems = []
    if mc.transformer_config_kwargs.get("moe_router_fusion"):
        problems.append(Problem(f"{prefix}.transformer_config_kwargs.moe_router_fusion",
                                "Transformer Engine's fused router picks experts inside its kernel, where no route can be replayed",
                                "drop moe_router_fusion, or set moe_config.routing_replay=null"))
    if replay == "r3":
        problems += _engine_route_problems(cfg, key)
    return problems


def _device_all_to_all_problems(cfg, role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """Where `moe_config.device_all_to_all` can apply (model/moe/exchange_dispatcher.exchange_can_apply at
    build time is the backstop): expert TP 1, dropless top-k routing, grouped experts."""
    key = f"{prefix}.moe_config.device_all_to_all"
    if mc.moe_config.device_all_to_all is not True:
        return []
    problems = []
    expert_tp = mc.expert_tensor_parallel_size or mc.tensor_model_parallel_size
    if expert_tp != 1:
        problems.append(Problem(key, f"expert tensor parallelism ({expert_tp}) gathers tokens by host split sizes",
                                "set expert_tensor_parallel_size=1, or device_all_to_all=false"))
    kwargs = mc.transformer_config_kwargs
    dropping = [name for name in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                                  "moe_router_padding_for_quantization") if kwargs.get(name) not in (None, False)]
    if dropping:
        problems.append(Problem(key, f"it needs dropless top-k routing, and transformer_config_kwargs sets {', '.join(dropping)}",
                                f"drop {', '.join(dropping)}, or set device_all_to_all=false"))
    if kwargs.get("moe_grouped_gemm") is False:
        problems.append(Problem(key, "it needs grouped experts (they take the token counts on the device), and "
                                "transformer_config_kwargs.moe_grouped_gemm is false", "drop moe_grouped_gemm, or set device_all_to_all=false"))
    if int((cfg.trainer[role].model.get("lora") or {}).get("rank") or 0) > 0:
        problems.append(Problem(key, "LoRA keeps the experts per-expert modules (no grouped experts), which read the counts on the host",
                                "set device_all_to_all=false with LoRA"))
    return problems


def _split_overlap_problems(cfg, role: str, prefix: str, mc: MegatronWorkerConfig) -> list[Problem]:
    """Where `moe_config.overlap_all_to_all` can apply (model/moe/split_overlap.split_overlap_can_apply at
    build time is the backstop): dropless routing, our grouped MoE layer, no other overlap of the exchange.
    At EP1 it changes nothing (there is no all-to-all)."""
    key = f"{prefix}.moe_config.overlap_all_to_all"
    if mc.moe_config.overlap_all_to_all is not True:
        return []
    off = "or set overlap_all_to_all=false"
    problems = []
    kwargs = mc.transformer_config_kwargs
    dropping = [name for name in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                                  "moe_router_padding_for_quantization") if kwargs.get(name) not in (None, False)]
    if dropping:
        problems.append(Problem(key, f"a capacity or padding computed per half would drop or pad other tokens, and "
                                f"transformer_config_kwargs sets {', '.join(dropping)}", f"drop {', '.join(dropping)}, {off}"))
    for name, why in (("moe_shared_expert_overlap", "runs the shared experts inside the exchange the halves replace"),
                      ("overlap_moe_expert_parallel_comm", "(Megatron's own overlap) calls the layer's steps one by one, "
                                                           "not its forward")):
        if kwargs.get(name):
            problems.append(Problem(key, f"transformer_config_kwargs.{name} {why}", f"drop {name}, {off}"))
    if kwargs.get("moe_grouped_gemm") is False:
        problems.append(Problem(key, "it runs in our grouped MoE layer, and transformer_config_kwargs.moe_grouped_gemm "
                                "is false", f"drop moe_grouped_gemm, {off}"))
    if int((cfg.trainer[role].model.get("lora") or {}).get("rank") or 0) > 0:
        problems.append(Problem(key, "LoRA keeps Megatron's MoE layer with per-expert modules, which has no halves",
                                "set overlap_all_to_all=false with LoRA"))
    return problems


def _engine_route_problems(cfg, key: str) -> list[Problem]:
    """R3 needs the host to carry the engines' routes to our workers: skyrl 0.4 does (its generator
    keeps `rollout_expert_indices` under `generator.enable_return_routed_experts`, a key skyrl-train
    0.3.1 lacks) for its vLLM engines and our HF engine alike."""
    asks = cfg.generator.get("enable_return_routed_experts")
    if asks is None:
        return [Problem(key, "no engine's routes reach the trainer on skyrl-train 0.3.1 (its vLLM and SGLang "
                             "engines return none, and its generator keeps only tokens and logprobs)",
                        "use routing_replay=r2 (the policy's scoring routes replayed in training), or skyrl 0.4 for r3")]
    if not asks:
        return [Problem(key, "r3 replays the routes the inference engines return, and the host asks them for "
                             "routes only with generator.enable_return_routed_experts=true",
                        "set generator.enable_return_routed_experts=true, or use routing_replay=r2")]
    # skyrl 0.4's generator refuses these with routes only once it starts; say so up front
    problems = []
    if cfg.generator.get("step_wise_trajectories"):
        problems.append(Problem("generator.step_wise_trajectories", "a step-wise row's prompt is the whole history, but "
                                "the engine's routes of a step cover its new tokens only, so they cannot be replayed (r3)",
                                f"set generator.step_wise_trajectories=false, or {key}=r2"))
    if cfg.generator.get("use_conversation_multi_turn") is False:
        problems.append(Problem("generator.use_conversation_multi_turn", "without it the host appends an EOS token "
                                "the engine never routed, and trains it (r3 has no route to replay there)",
                                f"set generator.use_conversation_multi_turn=true, or {key}=r2"))
    return problems


def _fused_kernel_problems(key: str, names) -> list[Problem]:
    allowed = ", ".join(FUSED_KERNELS)
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        return [Problem(key, f"must be a list of kernel names, got {names!r}", f"list some of {allowed}, or [] for eager kernels")]
    moe_key = key.rpartition(".")[0] + ".moe_config.expert_gemms"
    return [
        Problem(key, f"{name!r} is no longer a fused kernel: {moe_key} chooses the MoE experts' GEMMs (auto by default: "
                     "quack-kernels where it runs, else torch._grouped_mm)",
                f"remove it from the list; set {moe_key}=quack to require quack")
        if name in _EXPERT_GEMM_KERNELS else
        Problem(key, f"unknown kernel {name!r}", _did_you_mean(name, FUSED_KERNELS) + f" (known: {allowed})")
        for name in names
        if name not in FUSED_KERNELS
    ]


def _attention_kernel_problems(key: str, kernel, runtime: str) -> list[Problem]:
    """What can be told before any worker starts; the GPU's generation is checked at model build
    (`model/layers/attention.select_segment_kernel`)."""
    if kernel not in ATTENTION_KERNELS:
        hint = _did_you_mean(str(kernel), ATTENTION_KERNELS)
        return [Problem(key, f"unknown kernel {kernel!r}", f"use one of {', '.join(ATTENTION_KERNELS)}"
                        + (f" ({hint})" if hint.startswith("did") else ""))]
    gpu_only = (SegmentKernel.FLASH4.value, SegmentKernel.VARLEN.value)
    if kernel in gpu_only and runtime == "cpu":
        return [Problem(key, f"{kernel} runs on GPUs, and runtime is cpu", "set attention_kernel=auto (masked SDPA on CPU)")]
    if kernel == SegmentKernel.FLASH4.value and not flash4_installed():
        return [Problem(key, "flash4 needs flash-attn-4 (the module flash_attn.cute), which is not installed here",
                        FLASH4_INSTALL_FIX)]
    return []


def flex_backend_available(backend: str) -> bool:
    """Whether Megatron found the flex dispatcher's communication library (DeepEP ships both backends)."""
    from skyrl_megatron.runtime import quiet_megatron_import

    with quiet_megatron_import():
        from megatron.core.transformer.moe import fused_a2a

    return {"deepep": fused_a2a.HAVE_DEEP_EP, "hybridep": fused_a2a.HAVE_HYBRIDEP}.get(backend, False)


def flex_backend_problem(settings: MoeSettings, prefix: str = "megatron_config.moe_config") -> Problem | None:
    """The flex dispatcher without its backend installed (Megatron's own ImportError, raised while the
    model is built on every rank, names no config key)."""
    if settings.token_dispatcher != "flex" or flex_backend_available(settings.flex_backend):
        return None
    library = "deep_ep.HybridEPBuffer" if settings.flex_backend == "hybridep" else "deep_ep (DeepEP)"
    return Problem(
        f"{prefix}.token_dispatcher",
        f"the flex dispatcher with backend {settings.flex_backend!r} needs {library}, which is not importable here",
        "install DeepEP on every worker node, or set token_dispatcher to alltoall or allgather",
    )


def _moe_backend_problems(prefix: str, settings: MoeSettings) -> list[Problem]:
    problem = flex_backend_problem(settings, prefix)
    return [problem] if problem is not None else []


def check_lora(cfg, role: str, mc: MegatronWorkerConfig, shape: ModelShape | None) -> list[Problem]:
    """`megatron_config.lora_config` and the host's `model.lora` keys map onto Megatron-Bridge's PEFT."""
    prefix = f"trainer.{role}.megatron_config.lora_config"
    settings = mc.lora_config
    problems = []
    if settings.lora_type not in LORA_TYPES:
        problems.append(Problem(f"{prefix}.lora_type", f"unknown LoRA type {settings.lora_type!r}", "use lora or canonical_lora"))
    if settings.weight_sync not in WEIGHT_SYNC_MODES:
        problems.append(Problem(f"{prefix}.weight_sync", f"unknown mode {settings.weight_sync!r}", "use merged or adapters"))
    if problems or int((cfg.trainer[role].model.get("lora") or {}).get("rank") or 0) <= 0:
        return problems
    try:
        spec = LoraSpec.from_host_config(cfg, role)
    except LoraConfigError as exc:
        return [Problem(f"trainer.{role}.model.lora", str(exc), "change the LoRA keys as described")]
    expert_tp = mc.expert_tensor_parallel_size or mc.tensor_model_parallel_size
    if spec is not None and shape is not None and shape.num_experts and expert_tp > 1 and spec.adapts_mlp:
        problems.append(
            Problem(
                f"trainer.{role}.megatron_config.expert_tensor_parallel_size",
                f"LoRA on the experts of {shape.model_type} needs the experts unsplit by TP, but expert TP is {expert_tp}",
                "set expert_tensor_parallel_size=1 (experts split over EP only), or target only attention modules",
            )
        )
    return problems


def _check_against_model(prefix: str, shape: ModelShape, tp: int, pp: int, vpp: int | None, ep: int) -> list[Problem]:
    problems = []
    if shape.num_attention_heads % tp:
        problems.append(
            Problem(
                f"{prefix}.tensor_model_parallel_size",
                f"the model's {shape.num_attention_heads} attention heads are not divisible by TP={tp}",
                f"choose a TP that divides {shape.num_attention_heads}",
            )
        )
    if shape.num_query_groups % tp:
        problems.append(
            Problem(
                f"{prefix}.tensor_model_parallel_size",
                f"the model's {shape.num_query_groups} key/value heads (query groups) are not divisible by TP={tp}",
                f"choose a TP that divides {shape.num_query_groups}",
            )
        )
    stages = pp * (vpp or 1)
    if shape.num_layers % stages:
        problems.append(
            Problem(
                f"{prefix}.pipeline_model_parallel_size",
                f"the model's {shape.num_layers} layers do not split evenly into PP*VPP = {pp}*{vpp or 1} = {stages} stages",
                f"choose PP and VPP whose product divides {shape.num_layers}",
            )
        )
    if ep > 1 and not shape.num_experts:
        problems.append(
            Problem(
                f"{prefix}.expert_model_parallel_size",
                f"expert parallelism ({ep}) was asked for, but {shape.model_type} is a dense model",
                "set expert_model_parallel_size=1",
            )
        )
    elif shape.num_experts and shape.num_experts % ep:
        problems.append(
            Problem(
                f"{prefix}.expert_model_parallel_size",
                f"the model's {shape.num_experts} experts are not divisible by EP={ep}",
                f"choose an EP that divides {shape.num_experts}",
            )
        )
    return problems


# auto: the host's own engines; cpu / gpu: our HF engine (engines/hf_engine.py) on CPU, or on a GPU of its own
ENGINES = ("auto", "cpu", "gpu")
HF_ENGINES = ("cpu", "gpu")


def gpu_sharing(cfg, role: str) -> str | None:
    """The placement key under which another model or the engines use this role's GPUs, or None (GPUs of its own)."""
    placement = cfg.trainer.placement
    if placement.get("colocate_all"):
        return "trainer.placement.colocate_all"
    if role in ("policy", "ref") and placement.get("colocate_policy_ref"):
        return "trainer.placement.colocate_policy_ref"
    return None


def check_inference_engine(cfg) -> list[Problem]:
    """`generator.engine`: what serves the locally run engines, and what our HF engine needs around it."""
    generator = cfg.generator
    engine = generator.get("engine", "auto")
    if engine not in ENGINES:
        return [Problem("generator.engine", f"unknown engine {engine!r}", f"use one of {', '.join(ENGINES)}")]
    if engine not in HF_ENGINES:
        policy = cfg.trainer.policy
        lora_sync = ((policy.get("megatron_config") or {}).get("lora_config") or {}).get("weight_sync", "merged")
        if cfg.trainer.strategy == "megatron" and int(policy.model.lora.rank or 0) > 0 and lora_sync == "adapters":
            # the host starts vLLM with LoRA enabled for its fsdp strategies only
            return [Problem("trainer.policy.megatron_config.lora_config.weight_sync",
                            "adapter sync needs engines started with LoRA enabled, which skyrl-train 0.3.1 does "
                            "not do for trainer.strategy=megatron",
                            "use weight_sync=merged (the default) with vLLM/SGLang; adapters work with generator.engine=cpu")]
        return []
    on_gpu = engine == "gpu"
    needs = [
        ("generator.weight_sync_backend", generator.weight_sync_backend, "nccl" if on_gpu else "gloo",
         "the GPU engine receives weights by CUDA IPC when colocated, else by NCCL broadcast" if on_gpu
         else "the CPU engine receives weights by gloo broadcast"),
    ]
    if not on_gpu:
        needs.append(("trainer.placement.colocate_all", cfg.trainer.placement.colocate_all, False,
                      "the CPU engine takes no GPU, so there is nothing to share"))
    needs += [
        ("generator.run_engines_locally", generator.run_engines_locally, True,
         "the engine runs as a local Ray actor"),
        ("generator.backend", generator.backend, "vllm",
         "the host keys sampling parameters and its checks on the backend name; our engine speaks vLLM's"),
    ]
    for key in ("inference_engine_tensor_parallel_size", "inference_engine_pipeline_parallel_size",
                "inference_engine_data_parallel_size", "inference_engine_expert_parallel_size"):
        needs.append((f"generator.{key}", generator[key], 1, "our engine is one process"))
    return [
        Problem(key, f"is {value!r} but generator.engine={engine} needs {wanted!r} ({why})", f"set {key}={wanted}")
        for key, value, wanted, why in needs
        if value != wanted
    ]


def check_logprob_heads(cfg) -> list[Problem]:
    """The policy's and the reference's logprob heads agree on `lse_gemm`: the KL term compares their logprobs, and
    the epilogue GEMM's (from the fp32 accumulator) differ from the two-kernel head's (from bf16 logits) by the
    logits' rounding, which would show as a KL between identical weights."""
    if cfg.trainer.get("strategy") != "megatron" or "ref" not in active_roles(cfg):
        return []
    kernels = {}
    for role in ("policy", "ref"):
        names = (cfg.trainer[role].get("megatron_config") or {}).get("fused_kernels")
        if names is not None and not isinstance(names, str):
            names = list(names)  # (an OmegaConf ListConfig on skyrl-train 0.3.1)
        if names is None or _fused_kernel_problems("", names):
            return []  # a missing group or a bad list is reported by check_megatron_role, alone
        kernels[role] = "lse_gemm" in names
    if kernels["policy"] == kernels["ref"]:
        return []
    key = "trainer.ref.megatron_config.fused_kernels"
    if kernels["policy"]:
        return [Problem(key, "the policy takes its logprobs from the head's epilogue GEMM (lse_gemm) but the reference "
                             "does not: their logprobs would differ by the logits' rounding, a KL between equal weights",
                        f"add lse_gemm to {key}, or remove it from trainer.policy.megatron_config.fused_kernels")]
    return [Problem(key, "the reference takes its logprobs from the head's epilogue GEMM (lse_gemm) but the policy does "
                         "not: their logprobs would differ by the logits' rounding, a KL between equal weights",
                    "add lse_gemm to trainer.policy.megatron_config.fused_kernels, or remove it here")]


def check_config(cfg) -> None:
    """Check the whole composed config against our rules; raise one ConfigError listing every problem.

    The host's own checks come after these (`validation.validate_config` runs both)."""
    problems = check_strategy(cfg)
    if problems:
        raise ConfigError(problems)
    problems += check_critic(cfg)
    problems += check_model_paths(cfg)
    problems += check_inference_engine(cfg)
    problems += check_preemption_signal(cfg)
    if cfg.trainer.strategy == "megatron":
        for role in active_roles(cfg):
            path = _model_path(cfg, role)
            shape = read_model_shape(path) if path else None
            problems += check_megatron_role(cfg, role, shape)
        problems += check_logprob_heads(cfg)
    if problems:
        raise ConfigError(problems)
