"""HF `peft`'s adapter files, and what the installed peft can load: asked without importing it (peft
imports torch, and config checks run before torch loads).

Our PEFT adapter export names MoE expert adapters per expert (`mlp.experts.<i>.gate_proj.lora_A.weight`),
as Megatron-Bridge exports them and vLLM loads them. transformers 5 fuses a MoE layer's experts into
`experts.gate_up_proj` / `experts.down_proj` parameters, so those per-expert modules no longer exist.
peft converts such an adapter onto the fused parameters at load time
(`peft/utils/transformers_weight_conversion.py`; peft 0.21.2 has it); peft 0.18.1 (skyrl 0.4's pin) has no such
conversion and leaves the expert adapters out, silently: the model it gives is base + attention
adapters only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"

# the module of peft that maps per-expert (transformers 4) adapter names onto transformers 5's fused experts
_FUSED_EXPERT_CONVERSION = Path("utils") / "transformers_weight_conversion.py"


def peft_loads_expert_adapters_into_fused_experts() -> bool:
    """Whether the installed peft converts per-expert LoRA adapters onto fused expert parameters."""
    spec = importlib.util.find_spec("peft")  # a top-level package: found, not imported
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / _FUSED_EXPERT_CONVERSION).is_file()


def installed_peft_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peft")
    except PackageNotFoundError:
        return "not installed"
