"""model/conversion/hf_tensors.py: the HF tensors Megatron-Bridge converts, read from shards opened once, are
bitwise the ones Bridge's own source reads, for a single-file and a sharded (indexed) checkpoint."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.testing import make_tiny_hf_model

    single = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("single"), seed=3)
    sharded = tmp_path_factory.mktemp("sharded")
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")  # many shards and an index
    return {"single": single, "sharded": sharded}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_tensors_equal_bridges_own_reads_with_each_shard_opened_once(checkpoints, layout, monkeypatch):
    import safetensors

    from skyrl_megatron.model.conversion.bridge_import import import_bridge
    from skyrl_megatron.model.conversion.hf_tensors import _source_class

    import_bridge()  # Megatron-Bridge without Transformer Engine
    from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource

    path = checkpoints[layout]
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert (len(shards) > 3) == (layout == "sharded")
    bridges = SafeTensorsStateSource(path)
    keys = bridges.get_all_keys()
    expected = {key: bridges.load_tensors([key])[key] for key in keys}

    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda file, *a, **k: opened.append(file) or real_open(file, *a, **k))
    ours = _source_class()(path)
    one_by_one = {key: ours.load_tensors([key])[key] for key in keys}
    all_at_once = ours.load_tensors(keys)
    for key in keys:
        assert torch.equal(one_by_one[key], expected[key]) and one_by_one[key].dtype == expected[key].dtype, key
        assert torch.equal(all_at_once[key], expected[key]), key
    # each shard opened once: by the key map's scan (no index) and by the reads, not per tensor
    assert len(opened) <= 2 * len(shards) and sorted({str(f).rsplit("/", 1)[-1] for f in opened}) == shards


def test_a_missing_key_names_it(checkpoints):
    from skyrl_megatron.model.conversion.hf_tensors import _source_class

    with pytest.raises(KeyError, match="model.layers.99.mlp"):
        _source_class()(checkpoints["sharded"]).load_tensors(["model.layers.99.mlp.gate.weight"])


def test_load_bridge_reads_through_it(checkpoints):
    from skyrl_megatron.model.build import load_bridge
    from skyrl_megatron.model.conversion.hf_tensors import _source_class

    bridge = load_bridge(str(checkpoints["sharded"]))
    assert type(bridge.hf_pretrained.state.source).__name__ == _source_class().__name__
