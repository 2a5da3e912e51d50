"""HF checkpoint -> Megatron (through Megatron-Bridge) under every parallel layout, on CPU over gloo.

Each layout must reproduce the Hugging Face model's logits (fp32) and export the exact HF weights.
Packed (THD) batches, with context parallelism and combined with TP+SP or PP, must reproduce HF's
logits sequence by sequence.
"""

from __future__ import annotations

import glob

import pytest
import torch

from skyrl_megatron.testing import run_on_ranks

BATCH, SEQ = 2, 12
LOGIT_ATOL = 1e-4


def _tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _megatron_logits_and_export(rank: int, hf_dir: str, layout: dict):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_megatron.compute.schedule import forward_only
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig(**layout)
    coords = initialize_model_parallel(parallel)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))
    # under CP each rank holds its load-balanced share of the sequence (identity without CP)
    split = ContextParallelSplit.for_padded(SEQ, coords.cp, parallel.context)
    tokens = split.local(_tokens())
    positions = split.local(torch.arange(SEQ).unsqueeze(0))

    def forward(model, micro_batch):
        return model(micro_batch, positions, None)

    def collect(output, micro_batch):
        logits = gather_from_tensor_model_parallel_region(output)
        return split.gather(logits, ps.get_context_parallel_group(), dim=1)

    micro_batches = [tokens[i : i + 1] for i in range(BATCH)]
    outputs = forward_only(built.chunks, micro_batches, forward, collect, seq_length=SEQ, micro_batch_size=1)
    logits = torch.cat(outputs) if outputs else None
    exported = {name: tensor.clone() for name, tensor in built.bridge.export_hf_weights(built.chunks, cpu=True)}
    return {"coords": coords, "logits": logits, "export": exported if rank == 0 else None}


def _hf_reference(hf_dir: str):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(_tokens()).logits
    files = {}
    for path in glob.glob(f"{hf_dir}/*.safetensors"):
        files.update(load_file(path))
    return logits, files


def _run_layouts(rank, world_size, hf_dir: str, jobs: list[tuple[str, str, dict]]):
    """Every (name, kind, layout) job of one world size in one spawn of ranks: process start-up and
    imports dominate a tiny model's run, and Megatron's groups can be rebuilt in place."""
    from skyrl_megatron.parallel import init_distributed

    init_distributed("cpu")
    run = {"padded": _megatron_logits_and_export, "packed": _megatron_packed_logits}
    return {(name, kind): run[kind](rank, hf_dir, layout) for name, kind, layout in jobs}


@pytest.fixture(scope="module")
def layout_results(checkpoints):
    """results[(name, kind)] per rank, computed once per (family, world size)."""
    cache = {}

    def get(family: str, world: int):
        if (family, world) not in cache:
            jobs = [(name, "padded", layout) for f, name, w, layout in CASES if f == family and w == world]
            jobs += [(name, "packed", layout) for f, name, w, layout in PACKED_CASES if f == family and w == world]
            cache[(family, world)] = run_on_ranks(_run_layouts, world, checkpoints(family)[0], jobs, timeout=900)
        return cache[(family, world)]

    return get


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from skyrl_megatron.testing import make_tiny_hf_model

    cache = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(family)
            make_tiny_hf_model(family, out, seed=11)
            cache[family] = (str(out), *_hf_reference(str(out)))
        return cache[family]

    return get


DENSE = ["qwen3", "llama", "qwen2"]
FAMILIES = [*DENSE, "qwen3_moe"]
LAYOUTS = {
    "world1": (1, {}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline": 2}),
    "pp2_vpp2": (2, {"pipeline": 2, "virtual_pipeline": 2}),
    "dp2": (2, {}),
    "cp2": (2, {"context": 2}),
}
MOE_LAYOUTS = {
    "ep2": (2, {"expert": 2}),
    "tp2_ep2": (4, {"tensor": 2, "expert": 2, "sequence_parallel": True}),
}

CASES = [(f, name, *LAYOUTS[name]) for f in FAMILIES for name in LAYOUTS] + [
    ("qwen3_moe", name, *MOE_LAYOUTS[name]) for name in MOE_LAYOUTS
]


@pytest.mark.slow
@pytest.mark.parametrize("family,layout_name,world,layout", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_layout_matches_hf_logits_and_exports_bitwise(checkpoints, layout_results, family, layout_name, world, layout):
    hf_dir, hf_logits, hf_files = checkpoints(family)
    results = [per_rank[(layout_name, "padded")] for per_rank in layout_results(family, world)]
    with_logits = [r for r in results if r["logits"] is not None]
    assert with_logits, "no rank returned logits (last pipeline stage missing?)"
    for result in with_logits:
        logits = result["logits"][..., : hf_logits.shape[-1]]
        assert (logits - hf_logits).abs().max().item() <= LOGIT_ATOL
    exported = results[0]["export"]
    assert sorted(exported) == sorted(hf_files)
    for name, tensor in hf_files.items():
        assert torch.equal(exported[name], tensor), name


# ---- packed (THD) batches -----------------------------------------------------------------------------

PACKED_LENGTHS = (7, 12, 3, 9)
PACKED_CASES = [(family, "cp2", 2, {"context": 2}) for family in FAMILIES] + [
    # users combine CP with the other model-parallel dimensions
    ("qwen3", "tp2_sp_cp2", 4, {"tensor": 2, "sequence_parallel": True, "context": 2}),
    ("llama", "pp2_cp2", 4, {"pipeline": 2, "context": 2}),
]


def _packed_sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (n,), generator=gen) for n in PACKED_LENGTHS]


def _megatron_packed_logits(rank: int, hf_dir: str, layout: dict):
    """Logits per sequence of a skyrl-style padded batch, packed into one THD micro-batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch, unpack_to_padded
    from skyrl_megatron.compute.schedule import forward_only
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig(**layout)
    coords = initialize_model_parallel(parallel)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))

    sequences = _packed_sequences()
    tokens = torch.zeros(len(sequences), max(PACKED_LENGTHS) + 3, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, sequence in enumerate(sequences):
        left = i % 3  # a left-padded prompt, like skyrl-train's batches
        tokens[i, left : left + len(sequence)] = sequence
        mask[i, left : left + len(sequence)] = 1
    packed = pack_padded_batch(tokens, mask, parallel)
    split = ContextParallelSplit.for_packed(packed.packed_seq_params, coords.cp, parallel.context)

    def forward(model, batch):
        local_tokens, local_positions = split.local(batch.tokens), split.local(batch.position_ids)
        return model(local_tokens, local_positions, None, packed_seq_params=batch.packed_seq_params)

    def collect(output, batch):
        logits = gather_from_tensor_model_parallel_region(output)
        logits = unpack_to_padded(split.gather(logits, ps.get_context_parallel_group(), dim=1), batch)
        return [logits[i][mask[i].bool()] for i in range(len(sequences))]

    outputs = forward_only(built.chunks, [packed], forward, collect, seq_length=packed.num_tokens, micro_batch_size=1)
    return outputs[0] if outputs else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,layout_name,world,layout", PACKED_CASES, ids=[f"{c[0]}-{c[1]}-packed" for c in PACKED_CASES]
)
def test_packed_layout_matches_hf_logits_per_sequence(checkpoints, layout_results, family, layout_name, world, layout):
    from transformers import AutoModelForCausalLM

    hf_dir = checkpoints(family)[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = [model(sequence.unsqueeze(0)).logits[0] for sequence in _packed_sequences()]
    per_rank = [results[(layout_name, "packed")] for results in layout_results(family, world)]
    results = [r for r in per_rank if r is not None]
    assert results, "no rank returned logits (last pipeline stage missing?)"
    for per_sequence in results:
        for logits, reference in zip(per_sequence, expected, strict=True):
            assert logits.shape[0] == reference.shape[0]
            assert (logits[:, : reference.shape[-1]] - reference).abs().max().item() <= LOGIT_ATOL
