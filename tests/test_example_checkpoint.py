"""bench/gpu_examples.py's scaled checkpoint of an example's model: host-neutral (no host config is read), so
it runs on skyrl 0.4; the example scripts are checked in tests/test_examples.py."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the example readers are the bench's (bench/example_layouts.py)
from example_layouts import EXAMPLES, scale_example  # noqa: E402


def test_the_scaled_checkpoint_keeps_the_shape_it_is_given(tmp_path):
    """bench/gpu_examples.py writes the scaled model with random weights: every shape key (Qwen3-MoE's
    head_dim too, which its config class takes as a free keyword) and the vocabulary reach config.json,
    and transformers loads it (widths shrunk here to keep it small)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpu_examples import create_model

    example = scale_example(EXAMPLES / "run_qwen3_235b_a22b.sh", tmp_path / "launch", gpus=2)
    small = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}
    shrunk = type(example)(**{**example.__dict__, "model_config": {**example.model_config, **small}})
    create_model(shrunk, tmp_path / "model", cpu=True)
    config = AutoConfig.from_pretrained(tmp_path / "model")
    assert (config.model_type, config.num_hidden_layers) == ("qwen3_moe", example.layers)
    assert {key: getattr(config, key) for key in small} == small
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
