"""A vLLM engine's weights under Hugging Face names: what a weight sync can be checked against.

Our weight sync sends full tensors under HF names (``weights.iter_weight_buckets``); vLLM's
``load_weights`` folds several of them into one parameter: q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``, and a MoE layer's per-expert projections into ``w13_weight`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``w2_weight`` [E, H, I]. :func:`hf_weights` cuts each fused
parameter back along the boundaries vLLM's own mappings give (``packed_modules_mapping``, a linear
layer's ``output_partition_sizes``, the model's ``get_expert_mapping``), so the engine's tensors can be
compared with the trainer's export name for name. :func:`engine_weight_digests` runs inside a vLLM
worker (``collective_rpc``) and fingerprints them.

Under tensor parallelism each engine rank holds a shard: the shards are gathered over the engine's
tensor-parallel group (a collective: ``collective_rpc`` runs the read-back on every worker of the engine
at once, and every worker walks the same parameters in the same order), laid out as vLLM shards them:
column-parallel layers split each fused part's rows (a key/value head replicated over ranks when the
ranks outnumber the KV heads, kept once), row-parallel layers split columns, the vocabulary is split in
padded ranges, a MoE layer's experts split their intermediate dimension; under expert parallelism each
rank holds a subset of the experts, put back in place through every rank's expert map (gathered over the
engine's expert-parallel group). Layers of unknown layout, and expert maps that do not hold each expert
exactly once (redundant experts), are refused by name. vLLM is imported only to find its groups; layouts are
read from the model's modules, by their vLLM class names.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from skyrl_megatron.digests import tensor_sha256

# vLLM's shard ids of a fused MoE weight: w1 = gate, w3 = up (halves of w13), w2 = down
_W13_HALF = {"w1": 0, "w3": 1}
# vLLM linear layers whose weights every tensor-parallel rank holds whole (its `tp_size` notwithstanding)
_REPLICATED = ("ReplicatedLinear",)


class ShardedEngineError(ValueError):
    """The engine's ranks each hold a part that cannot be put back together here."""


def hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, the engine's whole tensor) for every parameter of a vLLM model; a tied weight once.

    Without tensor parallelism the tensors are views of the engine's; with it they are gathered copies."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    experts = _expert_shards(model)
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        layout = _layout(module_name, module)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            fused_into = module_name.rsplit(".", 1)[-1]
            if name.endswith(("w13_weight", "w2_weight")) and experts:
                yield from _split_experts(name, _whole_experts(module, param_name, param.data), experts)
            elif layout == "column":
                parts = _column_parts(module_name, module, param.data)
                if fused_into in packed:
                    yield from _name_parts(module_name, param_name, parts, packed[fused_into])
                else:
                    yield name, _cat(parts)
            elif layout == "row" and param_name == "weight":
                yield name, _cat(_gather(param.data, _tp_size(module)), dim=1)
            elif layout == "vocab":
                yield name, _cat(_gather(param.data, _tp_size(module)))[: module.org_vocab_size]
            else:  # whole on every rank (a row-parallel layer's bias too)
                yield name, param.data


def engine_weight_digests(worker, names: Collection[str] | None = None) -> dict[str, str]:
    """SHA-256 of each HF-named tensor the worker's model holds (those in `names`, else all).

    A ``collective_rpc`` target: vLLM calls it with its worker as the first argument (on every worker of an
    engine at once: a sharded engine's workers gather their shards together). Equal to
    ``MegatronPolicyWorker.weight_digests`` where the engine holds exactly the policy's weights.
    """
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    wanted = None if names is None else set(names)
    return {name: tensor_sha256(tensor) for name, tensor in hf_weights(model) if wanted is None or name in wanted}


def _class_names(module: torch.nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _tp_size(module: torch.nn.Module) -> int:
    size = getattr(module, "tp_size", 1)
    return size if isinstance(size, int) else 1


def _layout(module_name: str, module: torch.nn.Module) -> str:
    """How a module's parameters lie over the engine's ranks: "whole", "column", "row" or "vocab"."""
    classes = _class_names(module)
    if "ColumnParallelLinear" in classes:
        return "column"  # fused (q/k/v, gate/up) or not; at one rank, only cut into its parts
    if "VocabParallelEmbedding" in classes:
        if getattr(module, "num_added_embeddings", 0):
            raise ShardedEngineError(f"vLLM module {module_name!r} has added (LoRA) vocabulary rows: not read back")
        return "vocab"  # padded rows cut off, at any number of ranks
    moe = getattr(module, "moe_config", None)
    if moe is not None and getattr(moe, "ep_size", 1) > 1 and getattr(moe, "tp_size", 1) > 1:
        raise ShardedEngineError(
            f"vLLM module {module_name!r} splits its experts both ways (expert parallelism {moe.ep_size}, tensor "
            f"parallelism {moe.tp_size}): not read back"
        )
    if _tp_size(module) == 1 or classes & set(_REPLICATED):
        return "whole"
    if "RowParallelLinear" in classes:
        return "row"
    if not any(True for _ in module.parameters(recurse=False)):
        return "whole"
    raise ShardedEngineError(
        f"vLLM module {module_name!r} ({type(module).__name__}) is split over {_tp_size(module)} ranks in a layout "
        "this read-back does not know: run the check on an engine with tensor_parallel_size=1"
    )


def _gather(tensor: torch.Tensor, ranks: int, group: str = "tp") -> list[torch.Tensor]:
    """Every rank's shard of `tensor` over the engine's tensor- (or expert-) parallel group, in rank order
    (this rank's alone at one rank)."""
    if ranks == 1:
        return [tensor]
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    coordinator = parallel_state.get_tp_group() if group == "tp" else parallel_state.get_ep_group()
    shards = [torch.empty_like(tensor) for _ in range(ranks)]
    dist.all_gather(shards, tensor.contiguous(), group=coordinator.device_group)
    return shards


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)  # one rank: the engine's own view


def _column_parts(module_name: str, module: torch.nn.Module, tensor: torch.Tensor) -> list[torch.Tensor]:
    """A column-parallel weight's (or bias's) fused parts, whole: each rank holds its rows of every part."""
    sizes = list(getattr(module, "output_partition_sizes", None) or [tensor.shape[0]])
    if sum(sizes) != tensor.shape[0]:
        raise ValueError(f"vLLM {module_name} {list(tensor.shape)} does not split into parts of {sizes} rows")
    # q, k, v: with more ranks than KV heads, each KV head lies on `num_kv_head_replicas` ranks in a row
    replicas = getattr(module, "num_kv_head_replicas", 1) if "QKVParallelLinear" in _class_names(module) else 1
    every = [1] + [replicas] * (len(sizes) - 1) if replicas > 1 else [1] * len(sizes)
    per_rank = [shard.split(sizes) for shard in _gather(tensor, _tp_size(module))]
    return [_cat([parts[index] for parts in per_rank][:: every[index]]) for index in range(len(sizes))]


def _name_parts(module_name: str, param_name: str, parts: list[torch.Tensor], names: list[str]) -> Iterator:
    """qkv_proj -> q_proj, k_proj, v_proj (gate_up_proj -> gate_proj, up_proj)."""
    if len(parts) != len(names):
        raise ValueError(f"vLLM {module_name}.{param_name} has {len(parts)} parts, its packed mapping names {names}")
    parent = module_name.rsplit(".", 1)[0]
    for part, tensor in zip(names, parts, strict=True):
        yield f"{parent}.{part}.{param_name}", tensor


def _whole_experts(module: torch.nn.Module, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A MoE layer's fused expert weight with every expert in place and every rank's share of the intermediate
    dimension."""
    moe = getattr(module, "moe_config", None)
    tp = getattr(moe, "tp_size", 1) if moe is not None else 1
    if getattr(moe, "ep_size", 1) > 1:
        return _experts_in_place(module, param_name, tensor, moe.ep_size)
    if tp == 1:
        return tensor
    shards = _gather(tensor, tp)
    if param_name.startswith("w2"):  # [E, H, I / tp]
        return torch.cat(shards, dim=2)
    halves = [shard.chunk(2, dim=1) for shard in shards]  # [E, 2I / tp, H]: this rank's gate rows, then its up rows
    return torch.cat([torch.cat([gate for gate, _ in halves], dim=1), torch.cat([up for _, up in halves], dim=1)], dim=1)


def _experts_in_place(module: torch.nn.Module, param_name: str, tensor: torch.Tensor, ranks: int) -> torch.Tensor:
    """[E, ...] from each expert-parallel rank's [local experts, ...], placed by every rank's expert map (global
    expert -> local index, -1 where another rank holds it)."""
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        raise ShardedEngineError(f"vLLM expert weight {param_name!r}: expert parallelism without an expert map")
    maps = _gather(expert_map.to(device=tensor.device, dtype=torch.int64), ranks, group="ep")
    most = max(int((m >= 0).sum()) for m in maps)
    padded = tensor.new_zeros((most, *tensor.shape[1:]))  # ranks may hold different numbers of experts
    padded[: tensor.shape[0]] = tensor
    shards = _gather(padded, ranks, group="ep")
    whole = tensor.new_empty((expert_map.numel(), *tensor.shape[1:]))
    held = torch.zeros(expert_map.numel(), dtype=torch.int64, device=tensor.device)
    for shard, rank_map in zip(shards, maps, strict=True):
        experts = torch.nonzero(rank_map >= 0).flatten()
        whole[experts] = shard[rank_map[experts]]
        held[experts] += 1
    if not bool((held == 1).all()):
        raise ShardedEngineError(f"vLLM expert weight {param_name!r}: the ranks' expert maps do not hold each expert "
                                 "exactly once (redundant experts): not read back")
    return whole


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
