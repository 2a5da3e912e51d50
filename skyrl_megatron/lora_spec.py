"""What LoRA to apply, from the host's keys: `LoraSpec` and its checks (pure Python, no torch).

Config validation reads it before anything heavy loads; `model/adapters/lora.py` applies it to Megatron chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
LORA_TYPES = ("lora", "canonical_lora")
WEIGHT_SYNC_MODES = ("merged", "adapters")
ALL_LINEAR = "all-linear"

# The projections "all-linear" adapts, in each flavour's Megatron names (the bridge's defaults).
_ALL_LINEAR_TARGETS = {
    "lora": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
    "canonical_lora": (
        "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2",
    ),
}
# HF projection name -> the Megatron module it lives in. `lora` keeps Megatron's fused linear_qkv and
# linear_fc1 (one adapter each, A shared by the fused parts); `canonical_lora` has one per HF projection.
_HF_TO_MEGATRON = {
    "lora": {
        "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
        "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
    },
    "canonical_lora": {
        "q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
        "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2",
    },
}
# A fused module takes one adapter for all its parts: naming only some of them would adapt the others too.
_FUSED_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}


class LoraConfigError(ValueError):
    """The LoRA settings cannot be mapped onto Megatron-Bridge's PEFT."""


@dataclass(frozen=True)
class LoraSpec:
    """Which adapters to add and how to initialise and ship them."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    lora_type: str = "lora"  # "lora" (fused qkv / fc1 adapters) | "canonical_lora" (one per HF projection)
    target_modules: tuple[str, ...] | str = ALL_LINEAR  # HF or Megatron module names, or "all-linear"
    exclude_modules: tuple[str, ...] = ()  # names removed from the targets
    init_method: str = "kaiming"  # LoRA A; B starts at zero, so training starts from the base model
    seed: int = 0  # adapter initialisation (layout-independent)
    weight_sync: str = "merged"  # "merged": base + BA under HF names | "adapters": a PEFT adapter

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        problems = []
        if not isinstance(self.rank, int) or self.rank < 1:
            problems.append(f"rank must be a positive integer, got {self.rank!r}")
        if self.lora_type not in LORA_TYPES:
            problems.append(f"lora_type {self.lora_type!r} is not one of {LORA_TYPES}")
        if self.init_method not in INIT_METHODS:
            problems.append(f"init_method {self.init_method!r} is not one of {INIT_METHODS}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            problems.append(f"weight_sync {self.weight_sync!r} is not one of {WEIGHT_SYNC_MODES}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise LoraConfigError("; ".join(problems))
        self.megatron_targets()  # fail at construction, not inside model building

    @classmethod
    def from_host_config(cls, cfg, role: str = "policy") -> LoraSpec | None:
        """The spec for `role` from the composed host config; None when `model.lora.rank` is 0 (no LoRA).

        Reads `trainer.<role>.model.lora.{rank, alpha, dropout, target_modules, exclude_modules,
        init_method}`, `trainer.<role>.megatron_config.lora_config.{lora_type, weight_sync}` and
        `trainer.seed`.
        """
        from omegaconf import OmegaConf

        role_cfg = cfg.trainer[role]
        lora = OmegaConf.to_container(role_cfg.model.lora, resolve=True)
        if int(lora.get("rank") or 0) <= 0:
            return None
        megatron_lora = role_cfg.get("megatron_config", {}).get("lora_config") or {}
        targets = lora.get("target_modules") or ALL_LINEAR
        return cls(
            rank=int(lora["rank"]),
            alpha=float(lora.get("alpha", 16)),
            dropout=float(lora.get("dropout") or 0.0),
            lora_type=str(megatron_lora.get("lora_type", "lora")),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            exclude_modules=tuple(lora.get("exclude_modules") or ()),
            init_method=str(lora.get("init_method", "kaiming")),
            seed=int(cfg.trainer.get("seed", 0)),
            weight_sync=str(megatron_lora.get("weight_sync", "merged")),
        )

    @property
    def adapts_mlp(self) -> bool:
        """Whether any target may be an MLP (in MoE models: expert) linear."""
        attention = {"linear_qkv", "linear_proj", "linear_q", "linear_k", "linear_v"}
        return any(target not in attention for target in self.megatron_targets())

    @property
    def scale(self) -> float:
        """What BA is multiplied by before it is added to the base weight."""
        return self.alpha / self.rank

    def megatron_targets(self) -> list[str]:
        """The target list for the bridge's PEFT, in Megatron module names (wildcard patterns pass through)."""
        mapping = _HF_TO_MEGATRON[self.lora_type]
        requested = _ALL_LINEAR_TARGETS[self.lora_type] if self.target_modules == ALL_LINEAR else self.target_modules
        if isinstance(requested, str):
            raise LoraConfigError(f"target_modules must be {ALL_LINEAR!r} or a list of module names, got {requested!r}")
        if self.lora_type == "lora":
            _check_fused_parts(requested)
        excluded = {mapping.get(name, name) for name in self.exclude_modules}
        targets: list[str] = []
        for name in requested:
            target = mapping.get(name, name)
            if target not in excluded and target not in targets:
                targets.append(target)
        if self.lora_type == "canonical_lora":
            fused = [t for t in targets if t.endswith(("linear_qkv", "linear_fc1"))]
            if fused:
                raise LoraConfigError(
                    f"canonical_lora adapts q/k/v and gate/up separately; replace {fused} by their parts "
                    "(q_proj, k_proj, v_proj / gate_proj, up_proj) or use lora_type=lora"
                )
        if not targets:
            raise LoraConfigError(f"no module is left to adapt: targets {requested} minus {self.exclude_modules}")
        return targets


def _check_fused_parts(requested: Sequence[str]) -> None:
    named = set(requested)
    for fused, parts in _FUSED_PARTS.items():
        present = [p for p in parts if p in named]
        if present and len(present) < len(parts):
            missing = [p for p in parts if p not in named]
            raise LoraConfigError(
                f"lora_type=lora adapts {'/'.join(parts)} together (Megatron's fused {fused}); "
                f"targets name {present} but not {missing}: add them, or use lora_type=canonical_lora"
            )

