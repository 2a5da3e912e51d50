"""Our weight stream against vLLM's own model classes (the vLLM release the GPU machines run).

A Megatron model exports its HF-named buckets (under tensor, data and expert parallelism, in the engine's
bf16); a vLLM model of the same checkpoint, built on the CPU (one rank, or two ranks of vLLM's own tensor
parallelism over gloo), consumes them bucket by bucket through its ``load_weights`` as an engine worker does
after a sync. Then, on every engine rank:

* every vLLM parameter was written (vLLM reports the names it loaded);
* reading the engine back under HF names (``engines.vllm_weights.hf_weights``, which gathers a sharded
  engine's shards and cuts vLLM's fused q/k/v, gate/up and expert tensors apart) gives exactly the names we
  sent, each bitwise equal: the digests a sync check compares agree; on skyrl 0.4, also through the worker
  extension the adapter names for its servers (``engines.vllm_extension``), mixed into a worker class as vLLM
  mixes it. The sharded cases cover a KV head replicated over the engine's ranks, q/k/v biases, a vocabulary
  padded past its size, experts split over their intermediate dimension (TP), and experts split over the
  engine's ranks (EP, placed back through the ranks' expert maps).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import run_on_ranks

BUCKET_BYTES = 48_000  # several buckets per model, as a sync of a real model sends


def test_vllm_is_the_release_the_gpu_machines_run():
    import vllm

    # vLLM 0.24.0 is the release built for torch 2.11 (the GPU machines' torch); the hosts pin others
    assert vllm.__version__ == "0.24.0"
    assert torch.__version__.split("+")[0] == "2.11.0"


def _export_buckets(rank, world_size, hf_dir: str, layout: dict):
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.weights import iter_weight_buckets

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))
    buckets = [list(zip(b.names, b.tensors, strict=True))
               for b in iter_weight_buckets(built, BUCKET_BYTES, dtype=torch.bfloat16, device="cpu")]
    return buckets if rank == 0 else None


def _load_into_vllm(rank, world_size, hf_dir: str, buckets, expert_parallel: bool = False):
    from skyrl_megatron.digests import tensor_sha256
    from skyrl_megatron.engines.vllm_weights import engine_weight_digests, hf_weights
    from skyrl_megatron.testing import vllm_model_on_cpu

    model = vllm_model_on_cpu(hf_dir, torch.bfloat16, expert_parallel=expert_parallel)
    for parameter in model.parameters():
        parameter.data.fill_(float("nan"))  # a parameter no bucket writes cannot pass for a loaded one
    loaded: set[str] = set()
    for bucket in buckets:
        loaded |= set(model.load_weights(bucket))

    class WorkerBase:
        pass

    class Worker(WorkerBase):  # what collective_rpc hands its target: a worker whose model is this one
        def get_model(self):
            return model

    # skyrl 0.4's servers: our extension, named as the adapter names it, mixed in as vLLM's worker wrapper does
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from skyrl_megatron.engines.vllm_extension import READ_BACK_METHOD
    from skyrl_megatron.hosts.skyrl_0_4 import WEIGHT_READ_BACK

    Worker.__bases__ = Worker.__bases__ + (resolve_obj_by_qualname(WEIGHT_READ_BACK),)
    read_back_by_name = getattr(Worker(), READ_BACK_METHOD)(["model.norm.weight", "lm_head.weight"])

    return {
        "loaded": loaded,
        "parameters": {name for name, _ in model.named_parameters()},
        "read_back": {name: tensor_sha256(tensor) for name, tensor in hf_weights(model)},
        "digests_of_some": engine_weight_digests(Worker(), ["model.norm.weight", "lm_head.weight"]),
        "read_back_by_name": read_back_by_name,
        "fused": sorted(name for name, _ in model.named_parameters() if "qkv_proj" in name or "w13" in name)[:1],
        "sharded": model.get_parameter("lm_head.weight").shape[0] < model.config.vocab_size,
    }


CASES = {
    # family, layout of the exporting Megatron model (two ranks), the engine's ranks, its expert parallelism
    # (vLLM's enable_expert_parallel), model overrides
    "qwen3-tp2": ("qwen3", {"tensor": 2}, 1, False, {}),
    "qwen3_moe-ep2": ("qwen3_moe", {"expert": 2}, 1, False, {}),
    # one KV head on two engine ranks (replicated), q/k/v biases, 250 tokens padded to 256 (rank 1's last rows)
    "qwen2_one_kv_head-dp2-engine_tp2": ("qwen2", {}, 2, False, {"num_key_value_heads": 1, "vocab_size": 250}),
    "qwen3_moe-ep2-engine_tp2": ("qwen3_moe", {"expert": 2}, 2, False, {}),
    # attention TP2, each engine rank half the experts (placed back through the ranks' expert maps)
    "qwen3_moe-tp2-engine_tp2_ep2": ("qwen3_moe", {"tensor": 2}, 2, True, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_our_export_loads_into_vllm_and_reads_back_bitwise(case, tmp_path):
    from skyrl_megatron.digests import tensor_sha256
    from skyrl_megatron.testing import make_tiny_hf_model

    family, layout, engine_tp, engine_ep, overrides = CASES[case]
    hf_dir = str(make_tiny_hf_model(family, tmp_path / family, seed=3, num_hidden_layers=2, **overrides))
    buckets = run_on_ranks(_export_buckets, 2, hf_dir, layout, timeout=300)[0]
    assert len(buckets) > 2
    sent = {name: tensor_sha256(tensor) for bucket in buckets for name, tensor in bucket}

    engine_ranks = run_on_ranks(_load_into_vllm, engine_tp, hf_dir, buckets, engine_ep, timeout=300)
    assert len(engine_ranks) == engine_tp
    for engine in engine_ranks:
        assert engine["fused"], "the vLLM model fuses tensors (the case this checks)"
        assert engine["loaded"] == engine["parameters"], sorted(engine["parameters"] - engine["loaded"])
        assert engine["sharded"] == (engine_tp > 1), "each engine rank holds a shard only under tensor parallelism"
        assert set(engine["read_back"]) == set(sent), sorted(set(engine["read_back"]) ^ set(sent))
        differing = [name for name in sent if engine["read_back"][name] != sent[name]]
        assert differing == [], differing[:5]
        assert engine["digests_of_some"] == {name: sent[name] for name in ("model.norm.weight", "lm_head.weight")}
        # skyrl 0.4's servers: the same read-back through the worker extension's method, which /collective_rpc calls
        assert engine["read_back_by_name"] == engine["digests_of_some"]


def test_what_the_read_back_cannot_put_together_is_refused_by_name():
    from types import SimpleNamespace

    from skyrl_megatron.engines.vllm_weights import ShardedEngineError, hf_weights

    unknown = torch.nn.Module()  # split over two ranks, in no layout vLLM's parallel layers have
    unknown.proj = torch.nn.Linear(4, 12, bias=False)
    unknown.proj.tp_size = 2
    with pytest.raises(ShardedEngineError, match=r"'proj' \(Linear\) is split over 2 ranks .*tensor_parallel_size=1"):
        list(hf_weights(unknown))

    both = torch.nn.Module()  # experts split over ranks and each expert split too
    both.routed = torch.nn.Module()
    both.routed.w13_weight = torch.nn.Parameter(torch.zeros(2, 8, 4))
    both.routed.moe_config = SimpleNamespace(ep_size=2, tp_size=2)
    with pytest.raises(ShardedEngineError, match=r"'routed' splits its experts both ways"):
        list(hf_weights(both))

    from skyrl_megatron.engines.vllm_weights import _experts_in_place

    routed = torch.nn.Module()  # an expert map that leaves expert 2 to nobody (as redundant experts' maps do)
    routed.expert_map = torch.tensor([0, 1, -1, 2])
    with pytest.raises(ShardedEngineError, match="do not hold each expert exactly once"):
        _experts_in_place(routed, "w13_weight", torch.zeros(3, 8, 4), ranks=1)


def test_experts_are_put_back_where_the_expert_map_says():
    """One rank's view of the placement step: local row i is the global expert whose map entry is i (vLLM's
    Qwen3-MoE placement is contiguous, which the engine cases above cover; the map decides in general)."""
    from skyrl_megatron.engines.vllm_weights import _experts_in_place

    routed = torch.nn.Module()
    routed.expert_map = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # global expert -> local row
    local = torch.arange(4.0).view(4, 1, 1).expand(4, 2, 3).contiguous()  # local row r holds the value r
    whole = _experts_in_place(routed, "w13_weight", local, ranks=1)
    assert whole[:, 0, 0].tolist() == [2.0, 0.0, 3.0, 1.0]
