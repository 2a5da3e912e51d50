"""Tiny Hugging Face checkpoints with random weights, written to disk for offline tests.

Tests of weight conversion, tensor/pipeline/expert parallelism and logprob parity need a real HF
checkpoint directory, but downloading one is impossible offline and far too large anyway. These
builders produce a few-hundred-kilobyte checkpoint of a real architecture (config, safetensors,
generation config and the tiny tokenizer), loadable with `AutoModelForCausalLM.from_pretrained`.

The default shapes are chosen to divide cleanly for parallelism: 4 layers (pipeline 2 or 4),
4 attention / 2 KV heads (tensor parallel 2), vocab 256 and 8 experts (divisible by 2, 4 and 8).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from skyrl_megatron.testing.tokenizer import make_tiny_tokenizer

FAMILIES: tuple[str, ...] = ("qwen3", "llama", "qwen2", "qwen3_moe")

_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}

_COMMON_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    # transformers 5 keeps rope settings in `rope_parameters`; a bare `rope_theta` is legacy input.
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

# Qwen2 and Qwen3-MoE have no `head_dim` field; they derive hidden_size / num_attention_heads = 16.
_FAMILY_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},
    "llama": {"head_dim": 16},
    "qwen2": {},
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
}

# Spread of the perturbation applied to parameters that the model's own init leaves constant.
_PERTURB_STD = 0.1


def tiny_config(family: str, *, vocab_size: int = 256, **overrides: Any) -> PretrainedConfig:
    """Build the tiny config for `family`, with special-token ids taken from the tiny tokenizer.

    Overrides are checked against the config's declared fields, because an unknown keyword is
    otherwise stored silently and a misspelled override (``num_layers=2``) would go unnoticed.
    """
    config_cls, _ = _architecture(family)
    # head_dim: read by every Qwen3 attention, but Qwen3MoeConfig takes it as a free keyword
    known = {field.name for field in dataclasses.fields(config_cls)} | {"head_dim"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown {config_cls.__name__} field(s): {', '.join(unknown)}")
    tokenizer = make_tiny_tokenizer(vocab_size)
    fields = {
        **_COMMON_CONFIG,
        **_FAMILY_CONFIG[family],
        "vocab_size": vocab_size,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    return config_cls(**fields)


def make_tiny_hf_model(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = 256,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight checkpoint of `family` plus its tokenizer to `out_dir`.

    The same `seed` always gives bitwise-identical weights, so two processes (or two backends)
    can build the "same" model independently. The caller's global RNG state is left untouched.
    """
    _, model_cls = _architecture(family)
    config = tiny_config(family, vocab_size=vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    _perturb_constant_parameters(model, seed)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )

    out_path = Path(out_dir)
    model.save_pretrained(out_path, safe_serialization=True)
    make_tiny_tokenizer(vocab_size).save_pretrained(out_path)
    return out_path


def _architecture(family: str) -> tuple[type[PretrainedConfig], type[PreTrainedModel]]:
    """Look up the config and model classes, failing with the list of supported families."""
    if family not in _ARCHITECTURES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    return _ARCHITECTURES[family]


@torch.no_grad()
def _perturb_constant_parameters(model: PreTrainedModel, seed: int) -> None:
    """Make norm weights differ from 1 and biases differ from 0.

    HF init sets RMSNorm weights to ones and biases to zeros. A conversion that drops a norm weight
    or a bias would then still match the reference exactly; perturbing them makes such bugs show up
    as numerical mismatches. A dedicated generator keeps this independent of the init RNG stream.
    """
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        is_norm = type(module).__name__.endswith("RMSNorm")
        for name, param in module.named_parameters(recurse=False):
            noise = _PERTURB_STD * torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if is_norm and name == "weight":
                param.copy_(1.0 + noise)
            elif name == "bias":
                param.copy_(noise)
