"""A vLLM engine's weights under Hugging Face names: what a weight sync can be checked against.

Our weight sync sends full tensors under HF names (``weights.iter_weight_buckets``); vLLM's
``load_weights`` folds several of them into one parameter: q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``, and a MoE layer's per-expert projections into ``w13_weight`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``w2_weight`` [E, H, I]. :func:`hf_weights` cuts each fused
parameter back along the boundaries vLLM's own mappings give (``packed_modules_mapping``, a linear
layer's ``output_sizes``, the model's ``get_expert_mapping``), so the engine's tensors can be compared
with the trainer's export name for name. :func:`engine_weight_digests` runs inside a vLLM worker
(``collective_rpc``) and fingerprints them.

vLLM is not imported here: the functions read the model they are given. One engine rank holds whole
tensors only without tensor or expert parallelism, so a sharded engine is refused by name.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from skyrl_megatron.digests import tensor_sha256

# vLLM's shard ids of a fused MoE weight: w1 = gate, w3 = up (halves of w13), w2 = down
_W13_HALF = {"w1": 0, "w3": 1}


class ShardedEngineError(ValueError):
    """The engine's ranks each hold a shard, so one rank cannot give whole HF tensors."""


def hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, view of the engine's tensor) for every parameter of a vLLM model; a tied weight once."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    experts = _expert_shards(model)
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        _refuse_sharded(module_name, module)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            fused_into = module_name.rsplit(".", 1)[-1]
            if name.endswith(("w13_weight", "w2_weight")) and experts:
                yield from _split_experts(name, param.data, experts)
            elif fused_into in packed and getattr(module, "output_sizes", None):
                yield from _split_packed(module_name, param_name, param.data, packed[fused_into], module.output_sizes)
            else:
                yield name, param.data


def engine_weight_digests(worker, names: Collection[str] | None = None) -> dict[str, str]:
    """SHA-256 of each HF-named tensor the worker's model holds (those in `names`, else all).

    A ``collective_rpc`` target: vLLM calls it with its worker as the first argument. Equal to
    ``MegatronPolicyWorker.weight_digests`` where the engine holds exactly the policy's weights.
    """
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    wanted = None if names is None else set(names)
    return {name: tensor_sha256(tensor) for name, tensor in hf_weights(model) if wanted is None or name in wanted}


def _refuse_sharded(module_name: str, module: torch.nn.Module) -> None:
    for attribute in ("tp_size", "ep_size"):
        size = getattr(module, attribute, 1)
        if isinstance(size, int) and size > 1:
            raise ShardedEngineError(
                f"vLLM module {module_name!r} is split over {size} ranks ({attribute}): reading whole HF tensors back "
                "needs an engine with tensor_parallel_size=1 and no expert parallelism (use more engines instead)"
            )


def _split_packed(module_name: str, param_name: str, tensor: torch.Tensor, parts: list[str], sizes) -> Iterator:
    """qkv_proj -> q_proj, k_proj, v_proj (gate_up_proj -> gate_proj, up_proj): rows in `sizes`."""
    if len(parts) != len(sizes) or sum(sizes) != tensor.shape[0]:
        raise ValueError(f"vLLM {module_name}.{param_name} {list(tensor.shape)} does not split into {parts} of {sizes}")
    parent = module_name.rsplit(".", 1)[0]
    for part, rows in zip(parts, tensor.split(list(sizes), dim=0), strict=True):
        yield f"{parent}.{part}.{param_name}", rows


def _expert_shards(model: torch.nn.Module) -> list[tuple[str, str, int, str]]:
    """vLLM's (fused parameter prefix, HF prefix, expert, shard id) rows; none for a dense model."""
    mapping = getattr(model, "get_expert_mapping", None)
    return list(mapping()) if callable(mapping) else []


def _split_experts(name: str, tensor: torch.Tensor, experts: list[tuple[str, str, int, str]]) -> Iterator:
    """w13_weight -> experts.<e>.gate_proj / up_proj, w2_weight -> experts.<e>.down_proj."""
    matched = False
    for fused_prefix, hf_prefix, expert, shard in experts:
        if fused_prefix not in name:
            continue
        matched = True
        hf_name = name.replace(fused_prefix, hf_prefix)  # ...experts.w13_weight -> ...experts.<e>.gate_proj.weight
        rows = tensor[expert]
        if shard in _W13_HALF:
            half = rows.shape[0] // 2
            rows = rows[_W13_HALF[shard] * half:(_W13_HALF[shard] + 1) * half]
        yield hf_name, rows
    if not matched:
        raise ValueError(f"vLLM expert weight {name!r} matches none of the model's expert mapping")
