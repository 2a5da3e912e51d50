"""skyrl 0.4's vLLM weight sync, our half: the ``WeightSource`` our policy gives 0.4's transfer engine.

The vLLM installed here (0.24, the release built for this torch) predates the two base names 0.30 added
(``ParamMeta``, ``WeightSource`` in ``vllm.distributed.weight_transfer.base``): they come from a STAND-IN module
made by this test (on the GPU machines, from the bench's bridge); everything
else is real: a TP2 Megatron model on two CPU ranks, exported through our exporter. Asserted on every
rank: the declared stream equals the iterated one element for element, each tensor equals the HF
checkpoint bitwise (in the engine's dtype), and a backend our plain source cannot serve is refused. And the
policy worker's `weight_digests` (what the demo compares with the servers' read-back after each sync) fingerprints
exactly what the source streams, in the dtype 0.4's transfer engine asked for: a 0.4 worker sees no generator config.
"""

from __future__ import annotations

import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks

pytestmark = pytest.mark.slow


def _install_vllm_stand_in() -> None:
    """STAND-IN for vllm.distributed.weight_transfer.base (vLLM has no CPU wheel for this stack)."""

    @dataclass(frozen=True)
    class ParamMeta:
        name: str
        dtype: torch.dtype
        shape: tuple[int, ...]

    class WeightSource(ABC):
        @abstractmethod
        def metadata(self) -> list: ...

        @abstractmethod
        def __iter__(self): ...

    module = types.ModuleType("vllm.distributed.weight_transfer.base")
    module.ParamMeta, module.WeightSource = ParamMeta, WeightSource
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[module.__name__] = module


def _source_on_rank(rank, world_size, hf_dir):
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.workers.vllm_source import exported_weight_source

    _install_vllm_stand_in()
    init_distributed("cpu")
    parallel = ParallelConfig(tensor=2)
    initialize_model_parallel(parallel)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))
    source = exported_weight_source(built, torch.bfloat16, "nccl", torch.device("cpu"))
    declared = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    streamed = {name: tensor.clone() for name, tensor in source}
    try:
        exported_weight_source(built, torch.bfloat16, "sharded_rdt", torch.device("cpu"))
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "declared": declared,
        "streamed_meta": [(name, t.dtype, tuple(t.shape)) for name, t in streamed.items()],
        "streamed": streamed,
        "refused": refused,
    }


def test_the_weight_source_declares_what_it_streams_and_streams_the_checkpoint(tmp_path):
    from safetensors.torch import load_file

    hf_dir = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=4)
    checkpoint = load_file(hf_dir / "model.safetensors")
    for result in run_on_ranks(_source_on_rank, 2, str(hf_dir), timeout=300):
        assert result["declared"] == result["streamed_meta"]
        streamed = result["streamed"]
        assert set(checkpoint) <= set(streamed)
        for name, tensor in checkpoint.items():
            assert torch.equal(streamed[name], tensor.to(torch.bfloat16)), name
        assert "resolves to 'sharded_rdt'" in result["refused"] and "weight_sync_backend=nccl" in result["refused"]


def _worker_digests_on_rank(rank, world_size, hf_dir):
    from omegaconf import OmegaConf

    from skyrl_megatron.digests import tensor_sha256
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.workers.offload import ModelOffloader
    from skyrl_megatron.workers.policy import MegatronPolicyWorker

    _install_vllm_stand_in()
    runtime = init_distributed("cpu")
    parallel = ParallelConfig(tensor=2)
    initialize_model_parallel(parallel)
    # the worker's own methods on a real model; only its Ray construction is skipped
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)
    worker.runtime = runtime
    worker.built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))
    worker.offloader = ModelOffloader(worker.built.chunks)
    worker.cfg = OmegaConf.create({"trainer": {"strategy": "megatron"}})  # 0.4's worker view: no generator section
    source = worker._build_weight_source(torch.bfloat16, "nccl")
    streamed = {name: tensor_sha256(tensor) for name, tensor in source}
    return {"digests": worker.weight_digests(), "streamed": streamed}


def test_the_policy_digests_what_its_source_streams_in_the_dtype_asked_for(tmp_path):
    hf_dir = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=4)
    rank0, rank1 = run_on_ranks(_worker_digests_on_rank, 2, str(hf_dir), timeout=300)
    assert rank0["digests"] == rank0["streamed"] and len(rank0["digests"]) > 0
    assert rank1["digests"] == {}  # rank 0 reports; the others take part in the gathers
