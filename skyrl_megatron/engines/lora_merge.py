"""A PEFT LoRA adapter folded into the engine's weights by checkpoint name, without peft.

Each adapted module's weight becomes W + s * B @ A, with s = lora_alpha / r (lora_alpha / sqrt(r) under
rsLoRA) and r the rank of that module's A, as peft merges it. The weight is found under its checkpoint
name (``<module>.weight``, per expert for MoE experts) through ``checkpoint_names``, the same views a
weight update writes, so per-expert adapters land in transformers 5's fused expert tensors.

Why not peft's own merge (``PeftModel.from_pretrained(...).merge_and_unload()``): peft before 0.21
(skyrl 0.4 pins 0.18.1) cannot put per-expert adapters onto fused experts and leaves them out
silently. This one path works with any peft, or none, and is as exact (the same logits as peft 0.21.2's
merge, bitwise, on a 166M dense and a 494M Qwen3-MoE model) and faster: it touches only the adapted
tensors, where peft's path copied the whole model (twice, to keep the base) and loaded every tensor
back (CPU, per load after the first: 1.8 s against 2.9 s dense, 3-5 s against 6-16 s MoE).

Adapters never stack: with adapter sync the trainer never sends base weights, so every adapter
applies to the weights as they were before any adapter touched them. Those are kept per adapted
tensor, in host memory (the engine's sleep moves the model to the host; a device copy would stay).

What the merge cannot represent (DoRA, trained biases, modules_to_save, packed 3-D parameter
targets, ...) is refused by its ``adapter_config.json`` key before any weight is written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from skyrl_megatron.peft_support import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE

_PREFIX = "base_model.model."  # peft's wrapper around the model, in every saved tensor name
_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"

# config keys whose feature changes what the adapter computes beyond B @ A: refused when set
_UNSUPPORTED_WHEN_SET = (
    "use_dora", "modules_to_save", "lora_bias", "fan_in_fan_out", "target_parameters", "alpha_pattern",
    "layer_replication", "trainable_token_indices", "use_qalora", "alora_invocation_tokens", "arrow_config",
    "megatron_config", "use_bdlora",
)
# initialisations that leave A and B alone, so the base they apply to is the unchanged checkpoint
# (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA rewrite the base weights at initialisation)
_BASE_PRESERVING_INITS = (True, False, "gaussian", "eva")


class AdapterError(ValueError):
    """An adapter the engine's merge does not support, or one that does not fit the model."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from disk: per adapted weight (checkpoint name) its A, B and scale."""

    path: str
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @classmethod
    def read(cls, directory: str | Path) -> LoraAdapter:
        from safetensors.torch import load_file

        directory = Path(directory)
        config = json.loads((directory / PEFT_CONFIG_FILE).read_text())
        _check_config(config, directory)
        tensors = load_file(str(directory / PEFT_WEIGHTS_FILE))
        factors = {}
        for name, lora_a in tensors.items():
            if name.endswith(_LORA_B):
                continue
            module = _module_of(name, directory)
            lora_b = tensors.get(f"{_PREFIX}{module}{_LORA_B}")
            if lora_b is None:
                raise AdapterError(f"{directory}: {name} has no lora_B")
            _check_targeted(module, config.get("target_modules"), directory)
            rank = lora_a.shape[0]
            if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_b.shape[1] != rank:
                raise AdapterError(f"{directory}: {module}'s A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} "
                                   "are not an r x in and out x r pair")
            if not config.get("rank_pattern") and rank != config["r"]:
                raise AdapterError(f"{directory}: {module} has rank {rank}, adapter_config.json r={config['r']}")
            scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
            factors[f"{module}.weight"] = (lora_a, lora_b, scale)
        if any(f"{_module_of(name, directory)}.weight" not in factors for name in tensors):
            raise AdapterError(f"{directory}: a lora_B without its lora_A")
        return cls(str(directory), factors)


def _check_config(config: dict, directory: Path) -> None:
    def refuse(key: str, why: str) -> AdapterError:
        return AdapterError(f"{directory / PEFT_CONFIG_FILE}: {key}={config.get(key)!r}: {why}; the engine merges "
                            "plain LoRA (W + scale * B @ A) only")

    if config.get("peft_type") != "LORA":
        raise refuse("peft_type", "not a LoRA adapter")
    if config.get("bias", "none") != "none":
        raise refuse("bias", "trained biases are not merged")
    for key in _UNSUPPORTED_WHEN_SET:
        if config.get(key):
            raise refuse(key, "not supported by the engine's merge")
    if config.get("init_lora_weights", True) not in _BASE_PRESERVING_INITS:
        raise refuse("init_lora_weights", "this initialisation rewrites the base weights the adapter was trained on")


def _module_of(name: str, directory: Path) -> str:
    """`base_model.model.<module>.lora_A.weight` -> `<module>`."""
    suffix = next((s for s in (_LORA_A, _LORA_B) if name.endswith(s)), None)
    if not name.startswith(_PREFIX) or suffix is None:
        raise AdapterError(f"{directory}: tensor {name} is not a LoRA A or B of a linear module "
                           f"({_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    return name[len(_PREFIX): -len(suffix)]


def _check_targeted(module: str, targets, directory: Path) -> None:
    """peft adapts the modules `target_modules` names (a list of name suffixes, a regex, or all-linear)."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):
        targeted = re.fullmatch(targets, module) is not None
    else:
        targeted = any(module == target or module.endswith(f".{target}") for target in targets)
    if not targeted:
        raise AdapterError(f"{directory}: tensors for {module}, which target_modules {targets!r} does not name")


class AdapterMerge:
    """Serves base + one adapter at a time, keeping each adapted weight's base as before its first adapter."""

    def __init__(self):
        self._base: dict[str, torch.Tensor] = {}  # checkpoint name -> the weight before any adapter, on the host

    @torch.no_grad()
    def apply(self, held: dict[str, torch.Tensor], adapter: LoraAdapter) -> None:
        """Write base + `adapter` into `held` (checkpoint-named views of the model, ``checkpoint_named_tensors``);
        weights an earlier adapter touched and this one does not go back to their base. Checked whole
        before anything is written."""
        for name, (lora_a, lora_b, _) in adapter.factors.items():
            target = held.get(name)
            if target is None:
                raise AdapterError(f"{adapter.path}: adapts {name}, which this model does not have")
            if (lora_b.shape[0], lora_a.shape[1]) != tuple(target.shape):
                raise AdapterError(f"{adapter.path}: B @ A of {name} is {lora_b.shape[0]} x {lora_a.shape[1]}, "
                                   f"the weight is {tuple(target.shape)}")
        for name in adapter.factors.keys() - self._base.keys():
            self._base[name] = held[name].detach().to("cpu", copy=True)
        for name, base in self._base.items():
            target = held[name]
            base = base.to(target.device)
            if name not in adapter.factors:
                target.copy_(base)
                continue
            lora_a, lora_b, scale = adapter.factors[name]
            delta = lora_b.to(target.device, torch.float32) @ lora_a.to(target.device, torch.float32)
            target.copy_(base.float() + scale * delta)  # summed in fp32, cast to the weight's dtype by the copy
