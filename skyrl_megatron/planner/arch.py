"""A decoder-only model's shape, read from its Hugging Face config.json, and its parameter counts.

Only what a memory plan needs: no weights, no transformers import. The families are the ones the
plugin converts through Megatron-Bridge: Llama, Qwen2 and Qwen3 (dense) and Qwen3-MoE.

Parameters are split the way Megatron shards them, per transformer layer:

* `tp_sharded`: split over tensor parallelism (QKV and output projections, the dense MLP, QKV biases);
* `replicated`: on every TP rank (RMSNorm weights, Qwen3's q/k norms, the MoE router, and the biases of
  row-parallel layers, which are added after the TP reduction);
* `expert`: the routed experts, split over expert parallelism (whole experts) and expert TP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_megatron.planner.errors import PlanError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one transformer layer, grouped by how Megatron shards them."""

    tp_sharded: int
    replicated: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only model, as far as its memory depends on it."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # the dense MLP's intermediate size
    tie_word_embeddings: bool
    qkv_bias: bool
    output_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is a routed MoE

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "model") -> "ModelArch":
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise PlanError(
                "--model",
                f"model_type {model_type!r} is not supported by the planner",
                f"use an HF config.json of one of: {', '.join(SUPPORTED_MODEL_TYPES)}",
            )

        def field(key: str) -> Any:
            if config.get(key) is None:
                raise PlanError("--model", f"the {model_type} config has no {key!r}", "pass the model's complete config.json")
            return config[key]

        hidden, heads = int(field("hidden_size")), int(field("num_attention_heads"))
        num_layers = int(field("num_hidden_layers"))
        attention_bias = bool(config.get("attention_bias", False))
        # Qwen2 always has QKV biases (and no output-projection bias); Llama and Qwen3 follow attention_bias.
        qkv_bias = True if model_type == "qwen2" else attention_bias
        experts = _num_experts(config) if model_type == "qwen3_moe" else 0
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=int(field("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(field("intermediate_size")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            output_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(config.get("mlp_bias", False)) and model_type == "llama",
            qk_norm=model_type in _QK_NORM_TYPES,
            num_experts=experts,
            experts_per_token=int(field("num_experts_per_tok")) if experts else 0,
            moe_ffn_hidden_size=int(field("moe_intermediate_size")) if experts else 0,
            moe_layers=_moe_layers(config, num_layers) if experts else (),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    # -- per-layer counts --------------------------------------------------------------------

    def attention_params(self) -> LayerParams:
        """Input norm, QKV and output projections, and Qwen3's per-head q/k norms."""
        h, d = self.hidden_size, self.head_dim
        qkv_out = (self.num_attention_heads + 2 * self.num_kv_heads) * d
        sharded = h * qkv_out + self.num_attention_heads * d * h + (qkv_out if self.qkv_bias else 0)
        replicated = h + (2 * d if self.qk_norm else 0) + (h if self.output_proj_bias else 0)
        return LayerParams(tp_sharded=sharded, replicated=replicated)

    def mlp_params(self, index: int) -> LayerParams:
        """Pre-MLP norm plus either the dense SwiGLU MLP or the router and routed experts."""
        h = self.hidden_size
        if self.is_moe_layer(index):
            expert = 3 * h * self.moe_ffn_hidden_size
            return LayerParams(tp_sharded=0, replicated=h + h * self.num_experts, expert=self.num_experts * expert)
        f = self.ffn_hidden_size
        bias_sharded, bias_replicated = (2 * f, h) if self.mlp_bias else (0, 0)
        return LayerParams(tp_sharded=3 * h * f + bias_sharded, replicated=h + bias_replicated)

    def layer_params(self, index: int) -> LayerParams:
        attention, mlp = self.attention_params(), self.mlp_params(index)
        return LayerParams(
            tp_sharded=attention.tp_sharded + mlp.tp_sharded,
            replicated=attention.replicated + mlp.replicated,
            expert=mlp.expert,
        )

    # -- whole-model counts (as in the HF checkpoint) ----------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_layer_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_parameters(self) -> int:
        layers = sum(self.layer_params(i).total for i in range(self.num_layers))
        return self.embedding_params + self.output_layer_params + layers + self.hidden_size  # + final norm

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to."""
        inactive_share = 1 - self.experts_per_token / self.num_experts if self.is_moe else 0.0
        experts = sum(self.layer_params(i).expert for i in range(self.num_layers))
        return self.num_parameters() - round(experts * inactive_share)


def _num_experts(config: Mapping[str, Any]) -> int:
    # The Qwen3-MoE checkpoints say num_experts; transformers 5 writes num_local_experts.
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        raise PlanError(
            "--model", "the qwen3_moe config has neither 'num_experts' nor 'num_local_experts'", "pass the model's complete config.json"
        )
    return int(experts)


def _moe_layers(config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    # HF Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
    dense_only = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def load_model_arch(path: str | Path) -> ModelArch:
    """A ModelArch from an HF config.json, or from a checkpoint directory holding one."""
    path = Path(path).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise PlanError(
            "--model",
            f"{str(path)!r} is neither a config.json nor a directory with one",
            "point --model at an HF config.json or a checkpoint directory",
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise PlanError("--model", f"{str(config_file)!r} is not valid JSON ({err})", "pass an HF config.json") from None
    name = config_file.parent.name if config_file.stem == "config" else config_file.stem
    return ModelArch.from_hf_config(config, name=name)
