"""The engine model's tensors under the names checkpoints (and our export) give them.

transformers 5 keeps a MoE layer's experts fused: ``mlp.experts.gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` [E, H, I]. Checkpoints, and the
HF names our weight export sends, hold one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight``); ``from_pretrained`` converts on load. A weight update arrives
under the checkpoint names, so the engine addresses the fused tensors through views under those names:
a copy into a view writes the fused parameter.

The views are taken afresh for each update: moving the model (sleep, wake) gives its parameters new
storage.
"""

from __future__ import annotations

import re

import torch

_FUSED_EXPERTS = re.compile(r"^(?P<experts>.*\.experts)\.(?P<projection>gate_up_proj|down_proj)$")


def _is_fused_experts(name: str, parameter: torch.Tensor):
    """The name's match (experts module, projection) where `parameter` is a fused [E, ...] expert tensor."""
    fused = _FUSED_EXPERTS.match(name)
    return fused if fused is not None and parameter.dim() == 3 else None


def checkpoint_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under its checkpoint name(s): fused expert tensors as per-expert views, tied
    weights under each of their names (an exporter may send either)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        fused = _is_fused_experts(name, parameter)
        if fused is None:
            tensors[name] = parameter
            continue
        experts, data = fused["experts"], parameter.data
        for expert in range(data.shape[0]):
            if fused["projection"] == "down_proj":
                tensors[f"{experts}.{expert}.down_proj.weight"] = data[expert]
            else:
                rows = data.shape[1] // 2
                tensors[f"{experts}.{expert}.gate_proj.weight"] = data[expert, :rows]
                tensors[f"{experts}.{expert}.up_proj.weight"] = data[expert, rows:]
    return tensors
