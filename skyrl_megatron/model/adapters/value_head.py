"""The critic's value model: the Megatron GPT trunk with a scalar value head in place of the LM head.

The trunk is built from the critic's HF checkpoint exactly as the policy's is (Megatron-Bridge, the
conversion cache, the same layer spec), so a critic started from the policy's checkpoint shares its
cache entry. Once the base weights are in place and before DDP wraps the chunks, the last pipeline
stage's vocabulary projection is replaced by :class:`ValueHead`, a [1, hidden] linear map; input and
output embeddings stop being tied (the critic has no output embedding to tie).

Initialisation follows the host's critic (skyrl-train's ``get_llm_for_sequence_regression``): a
critic that starts from the policy's checkpoint draws the head from N(0, 1/(hidden + 1)); one that
starts from another checkpoint takes ``<value_head_prefix>.weight`` from it when the checkpoint has
one (a saved critic), else draws N(0, initializer_range) as transformers initialises a new linear
layer. The draw comes from its own seeded generator, so every rank and every layout gets the same
head.

Parallel layouts: the head is replicated on the ranks of a TP group. Without sequence parallelism
every TP rank holds all tokens' hidden states and computes all values; the loss is the same on each,
so gradients need no reduction. With sequence parallelism each rank projects its own slice of the
tokens and the values are all-gathered along the sequence with a backward that keeps the rank's
own slice; the head's gradient is then partial per rank and summed over TP by Megatron's
``finalize_model_grads`` (the parameter is marked like a sequence-parallel norm weight). Context
parallelism and DP need nothing here: the runner gathers per-token outputs over CP as for logprobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_VALUE_HEAD_PREFIX = "value_head"


@dataclass(frozen=True)
class ValueHeadInit:
    """Where the head's weights come from: a tensor from the checkpoint, or a seeded normal draw."""

    hidden_size: int
    weight: torch.Tensor | None = None  # [1, hidden] from the checkpoint; None: draw
    std: float = 0.0
    seed: int = 0
    source: str = ""  # for the log: what decided the values

    @classmethod
    def for_checkpoint(
        cls, hf_path: str, *, policy_path: str | None, prefix: str = DEFAULT_VALUE_HEAD_PREFIX, seed: int = 0
    ) -> "ValueHeadInit":
        """How the host would initialise the head of a critic loaded from `hf_path`."""
        config = _read_config(hf_path)
        text = config.get("text_config") or config
        hidden = int(text["hidden_size"])
        if policy_path is not None and _same_path(hf_path, policy_path):
            # the host re-draws the head of a critic that starts from the policy (init_value_head)
            return cls(hidden, std=1.0 / (hidden + 1), seed=seed, source="N(0, 1/(hidden+1)), critic = policy checkpoint")
        saved = _read_saved_head(hf_path, f"{prefix}.weight")
        if saved is not None:
            if tuple(saved.shape) != (1, hidden):
                raise ValueError(
                    f"{hf_path}: {prefix}.weight has shape {tuple(saved.shape)}, expected (1, {hidden})"
                )
            return cls(hidden, weight=saved, source=f"{prefix}.weight from {hf_path}")
        std = float(text.get("initializer_range", 0.02))
        return cls(hidden, std=std, seed=seed, source=f"N(0, {std}) (no {prefix}.weight in the checkpoint)")

    def make_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight is not None:
            return self.weight.detach().to(torch.float32).clone().to(dtype)
        generator = torch.Generator().manual_seed(self.seed)
        return (torch.randn(1, self.hidden_size, generator=generator) * self.std).to(dtype)


def _read_config(hf_path: str) -> dict[str, Any]:
    config_file = Path(hf_path) / "config.json"
    if not config_file.is_file():
        from huggingface_hub import hf_hub_download

        config_file = Path(hf_hub_download(hf_path, "config.json"))
    return json.loads(config_file.read_text())


def _same_path(a: str, b: str) -> bool:
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def _read_saved_head(hf_path: str, name: str) -> torch.Tensor | None:
    """`name` from the checkpoint's safetensors, if one of its files holds it (a local directory only)."""
    from safetensors import safe_open

    root = Path(hf_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        file = json.loads(index.read_text()).get("weight_map", {}).get(name)
        files = [root / file] if file else []
    else:
        files = sorted(root.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] (this rank's sequence slice under SP) -> values [s, b] (all tokens), fp32.

    Stands where GPTModel keeps its ``output_layer``, so the model's own post-processing passes it
    to :class:`ValueOutputProcessor`; the name also keeps the checkpoint key ``output_layer.weight``.
    """

    is_value_head = True  # duck-typed marker (checkpoints, export) without importing this module
    # Megatron-Bridge exports a module with this attribute false as a replicated tensor (under the
    # LM head's HF name, which the export renames; see `weights.iter_hf_weights`)
    tensor_model_parallel = False

    def __init__(self, weight: torch.Tensor, *, sequence_parallel: bool, tp_group):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        # under SP each TP rank's gradient covers its own tokens: finalize_model_grads sums it over TP
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        values = (hidden @ self.weight.t()).squeeze(-1).float()  # [s/TP, b]
        if self.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank computes the same loss on all values: backward keeps the own slice (no sum)
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False, group=self.tp_group)
        return values


@dataclass(frozen=True)
class TokenValues:
    """Per-token values [b, s], 0 where the position has no next token (padding, a row's last token)."""

    values: torch.Tensor


@dataclass(frozen=True)
class ValueOutputProcessor:
    """``GPTModel.forward(output_processor=...)`` hook for a model whose output layer is a ValueHead.

    Takes the micro-batch's :class:`~skyrl_megatron.compute.logprobs.LogprobTargets` as context: its
    mask marks the positions that are states of the response (a next token follows). Elsewhere the
    value is 0, so past the end of a response GAE bootstraps from 0, the value of a finished episode.
    """

    def __call__(self, *, hidden_states: torch.Tensor, output_layer: torch.nn.Module, context: Any, **_unused: Any):
        if not getattr(output_layer, "is_value_head", False):
            raise TypeError("ValueOutputProcessor needs a model built with a value head (ModelSpec.value_head)")
        values = output_layer(hidden_states).t()  # [s, b] -> [b, s]
        if context is not None and context.mask is not None:
            values = values * context.mask.to(values.dtype)
        return TokenValues(values=values)


def value_head_hook(init: ValueHeadInit, dtype: torch.dtype):
    """A provider pre-wrap hook: the last stage's LM head becomes a ValueHead, embeddings untied."""

    def install(chunks: list) -> list:
        for chunk in chunks:
            model = _unwrap(chunk)
            # the critic has no output embedding; tied weights would all-reduce gradients of a head
            # that no longer exists between the first and the last pipeline stage
            model.share_embeddings_and_output_weights = False
            model.ends_in_value_head = True  # on every stage, so all ranks describe the model alike
            if not model.post_process:
                continue
            old = model.output_layer
            device = next(model.parameters()).device
            model.output_layer = ValueHead(
                init.make_weight(dtype).to(device),
                sequence_parallel=bool(getattr(old, "sequence_parallel", False)),
                tp_group=getattr(old, "tp_group", None),
            )
        return chunks

    return install


def _unwrap(chunk):
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
