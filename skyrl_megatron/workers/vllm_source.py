"""skyrl 0.4's weight sync to vLLM servers, fed by our exporter.

0.4 hands each policy rank a vLLM ``WeightSource`` (``metadata()`` and iteration, which must agree
element for element) and runs the transfer itself: NCCL broadcast or CUDA IPC into vLLM's packed
buffers, driven over HTTP (``build_trainer_engine``). Ours streams the HF-named full tensors of
``weights.iter_hf_weights``: every rank iterates (the gathers are collectives) and the host's engine
decides who sends. Imports vLLM, so it is loaded only when the inference client is the host's own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from skyrl_megatron.model.build import BuiltModel
from skyrl_megatron.weights import iter_hf_weights

# 0.4's transfer backends that take a plain source; sharded RDT pulls per-rank ownership we do not describe
PLAIN_SOURCE_BACKENDS = ("nccl", "ipc", "delta")


def exported_weight_source(built: BuiltModel, dtype: torch.dtype, backend: str, device: torch.device):
    """A vLLM ``WeightSource`` over the model's HF export in `dtype`, its tensors on `device`."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    if backend not in PLAIN_SOURCE_BACKENDS:
        raise ValueError(
            f"generator.inference_engine.weight_sync_backend resolves to {backend!r}, which skyrl-megatron's workers "
            f"cannot feed (they give a plain weight source: {', '.join(PLAIN_SOURCE_BACKENDS)}); use weight_sync_backend=nccl"
        )

    class ExportedWeights(WeightSource):
        """The declared stream is the export's (one dry export, cached: shapes cannot be known cheaper)."""

        def __init__(self) -> None:
            self._meta: list | None = None

        def metadata(self) -> list:
            if self._meta is None:
                self._meta = [ParamMeta(name, dtype, tuple(tensor.shape)) for name, tensor in self._export()]
            return self._meta

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self._export()

        def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(iter_hf_weights(built, dtype=dtype, device=device))

    return ExportedWeights()
