"""Reading a Hugging Face checkpoint's tensors for Megatron-Bridge's conversion, each shard opened once.

Bridge reads the HF weights through `SafeTensorsStateSource.load_tensors`, which for every tensor it is
asked for opens that tensor's shard and builds a set of all the shard's keys: quadratic in the tensors
per shard. MoE checkpoints have many (three per expert per layer): converting a tiny 8-layer Qwen3-MoE
with 128 experts (3,147 tensors, hidden 64) spent 15 of its 18 s there on CPU; a full Qwen3-30B-A3B
has 18,867 tensors. `OpenShardsSource` reads the same tensors by the key-to-shard map Bridge already
builds (from the index, or by one scan of the shards), from shard handles opened once and kept.
`read_shards_once(bridge)` gives a bridge that source; `build.load_bridge` calls it.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from skyrl_megatron.model.conversion.bridge_import import import_bridge


def _source_class() -> type:
    """`OpenShardsSource`, built on first use (Megatron-Bridge is imported late)."""
    import_bridge()
    from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource

    class OpenShardsSource(SafeTensorsStateSource):
        """Bridge's safetensors source whose shards stay open between reads (see the module doc)."""

        def __init__(self, path: str | Path):
            super().__init__(path)
            self._shards: dict[str, object] = {}

        def load_tensors(self, keys: list[str]) -> dict[str, Tensor]:
            key_map = self.key_to_filename_map
            if not key_map:  # no shard Bridge could map: its own search (and errors)
                return super().load_tensors(keys)
            missing = [key for key in keys if key not in key_map]
            if missing:
                raise KeyError(f"Keys not found in safetensors from {self.model_name_or_path}: {set(missing)}")
            return {key: self._shard(key_map[key]).get_tensor(key) for key in keys}

        def _shard(self, filename: str):
            shard = self._shards.get(filename)
            if shard is None:
                from safetensors import safe_open

                shard = self._shards[filename] = safe_open(self.path / filename, framework="pt", device="cpu")
            return shard

    return OpenShardsSource


def read_shards_once(bridge) -> bool:
    """Point `bridge`'s HF weight reads at `OpenShardsSource`. Returns whether it did: a bridge whose HF
    model is loaded in memory, or that has no checkpoint path, reads as Bridge does."""
    from megatron.bridge.models.hf_pretrained.state import StateDict

    pretrained = bridge.hf_pretrained
    path = getattr(pretrained, "model_name_or_path", None)
    if getattr(pretrained, "_model", None) is not None or not path or not Path(path).is_dir():
        return False
    pretrained._state_dict_accessor = StateDict(_source_class()(path))
    return True
