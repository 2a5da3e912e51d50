"""Hugging Face exports of a built model: merged safetensors shards, or a PEFT adapter directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from skyrl_megatron.checkpoint.atomic import PARTIAL_SUFFIX, check_replaceable, commit, sibling
from skyrl_megatron.checkpoint.errors import CheckpointError
from skyrl_megatron.checkpoint.integrity import MODEL_STATE_FULL
from skyrl_megatron.checkpoint.megatron_state import sharded_training_state
from skyrl_megatron.disk_room import bytes_to_write, free_bytes, node_shortfall
from skyrl_megatron.model.adapters.lora import PeftAdapter
from skyrl_megatron.peft_support import PEFT_CONFIG_FILE
from skyrl_megatron.weights import iter_hf_weights


def save_hf_model(
    export_dir: str | os.PathLike,
    built_model,
    tokenizer=None,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    adapters_only: bool = False,
    value_head_name: str = "value_head.weight",
) -> Path:
    """Write the model as a Hugging Face checkpoint (config, safetensors shards, tokenizer).

    `built_model` is a `skyrl_megatron.model.build.BuiltModel`. Collective: every rank takes part
    in gathering the weights (the bridge hands each rank full tensors under HF names); rank 0
    writes them shard by shard, so it holds at most one shard in memory. Published atomically
    like `save_checkpoint`; an existing export there is replaced, any other non-empty directory
    refused, and one that would not fit rank 0's disk is refused before any weight is gathered. A model with LoRA
    adapters is written merged (base + scale * BA); with
    `adapters_only`, as a PEFT adapter directory instead (adapter_config.json and
    adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, export_dir)`). A critic's
    value head is written as `value_head_name` (the host's `<value_head_prefix>.weight`), no LM head.
    """
    if adapters_only:
        return _save_peft_adapter(Path(export_dir).absolute(), built_model, tokenizer)
    final = Path(export_dir).absolute()
    check_replaceable(final, marker="config.json", what="a Hugging Face checkpoint")
    partial = sibling(final, PARTIAL_SUFFIX)
    rank = dist.get_rank()
    _ensure_room(built_model, final)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        # config, generation config and the source's tokenizer files
        built_model.bridge.hf_pretrained.save_artifacts(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    weights = iter_hf_weights(built_model, device="cpu", value_head_name=value_head_name)  # LoRA adapters merged in
    if rank == 0:
        _write_safetensors(weights, partial, max_shard_bytes)
    else:
        for _ in weights:  # the gather is collective; only rank 0 keeps the tensors
            pass
    commit(partial, final)
    return final


def _ensure_room(built_model, final: Path) -> None:
    """Raise CheckpointError on every rank when the merged weights (the model's tensors in their dtype, each
    counted once over its replicas: about the export's size, adapters counted in) do not fit on rank 0's disk,
    where all of them are written. Collective."""
    from skyrl_megatron.runtime import current_runtime

    state = sharded_training_state(built_model.chunks, None, None, is_loading=False, with_rng=False,
                                   model_state=MODEL_STATE_FULL)
    total = torch.tensor([bytes_to_write(state)], dtype=torch.int64, device=current_runtime().torch_device)
    dist.all_reduce(total)
    rank0 = dist.get_rank() == 0
    # an export being replaced is deleted only after the new one is complete: its room does not count
    short = node_shortfall(int(total.item()) if rank0 else 0, free_bytes(final) if rank0 else 0)
    if short is not None:
        raise CheckpointError(
            f"HF export {final}: {short.describe(final)}; nothing was written (an export already there stays). "
            f"Free space there, or point "
            f"trainer.export_path at a larger disk (or export less often: trainer.hf_save_interval)")


def _save_peft_adapter(final: Path, built_model, tokenizer) -> Path:
    check_replaceable(final, marker=PEFT_CONFIG_FILE, what="a PEFT adapter directory")
    partial = sibling(final, PARTIAL_SUFFIX)
    adapter = PeftAdapter.export(built_model)  # collective
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        adapter.save(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    commit(partial, final)
    return final


def _write_safetensors(named_tensors, out_dir: Path, max_shard_bytes: int) -> None:
    """Stream (name, tensor) pairs into safetensors shards plus the index transformers reads."""
    from safetensors.torch import save_file

    shard_files: list[Path] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = out_dir / f"model-{len(shard_files) + 1:05d}.safetensors"
            save_file(shard, path, metadata={"format": "pt"})
            shard_files.append(path)
            shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        weight_map[name] = len(shard_files)
        shard_bytes += size
        total_bytes += size
    flush()

    if len(shard_files) == 1:
        shard_files[0].rename(out_dir / "model.safetensors")
        return
    # the final names carry the shard count, known only now
    names = [f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors" for i in range(len(shard_files))]
    for path, name in zip(shard_files, names):
        path.rename(out_dir / name)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {tensor_name: names[i] for tensor_name, i in sorted(weight_map.items())},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


