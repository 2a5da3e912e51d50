"""Testing toolkit: multi-rank process launcher, tiny HF checkpoints and a tiny offline tokenizer.

Names are imported lazily. Every rank spawned by `run_on_ranks` re-imports this package to reach
its entry point, and eagerly importing `transformers` here would add seconds to each rank's
start-up for tests that never build a model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyrl_megatron.testing.distributed import DistributedTestError, init_single_rank, run_on_ranks
    from skyrl_megatron.testing.rl_batches import make_rl_batch, padded_token_rows
    from skyrl_megatron.testing.tiny_models import FAMILIES, make_tiny_hf_model, tiny_config
    from skyrl_megatron.testing.tokenizer import make_tiny_tokenizer, save_tiny_tokenizer
    from skyrl_megatron.testing.triton_interpreter import last_word_under_triton_interpreter, run_under_triton_interpreter
    from skyrl_megatron.testing.vllm_models import vllm_model_on_cpu

_EXPORTS = {
    "DistributedTestError": "distributed",
    "run_on_ranks": "distributed",
    "init_single_rank": "distributed",
    "make_rl_batch": "rl_batches",
    "padded_token_rows": "rl_batches",
    "FAMILIES": "tiny_models",
    "make_tiny_hf_model": "tiny_models",
    "tiny_config": "tiny_models",
    "make_tiny_tokenizer": "tokenizer",
    "save_tiny_tokenizer": "tokenizer",
    "run_under_triton_interpreter": "triton_interpreter",
    "last_word_under_triton_interpreter": "triton_interpreter",
    "vllm_model_on_cpu": "vllm_models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines `name` on first access (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
