"""MoE layers at EP1 without device-to-host syncs (model/moe/layer.py, model/moe/experts.py).

The counts-on-device path against the previous one (the dispatcher copies the counts to the host
and waits) on the same model: bitwise the same logits, gradients, permutation order, tokens per
expert and expert outputs, and no host read of a tensor in one MoE layer's forward and backward
(`testing/host_syncs.HostSyncProbe`, the CPU stand-in for `torch.cuda.set_sync_debug_mode`), where
the previous path makes some. Megatron's dropless `permute` (which we keep) against the
masked-select definition of its order, for random routing maps, several top-k and experts
without tokens, and free of data-dependent sizes.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.host_syncs import HostSyncProbe


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        grad.tolist()
        return grad * 2


def test_the_probe_sees_value_reads_value_sized_operators_and_waits_in_forward_and_backward():
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with HostSyncProbe() as probe:
        torch.nonzero(x)
        bool(x[1])
        torch.cuda.Event.synchronize  # noqa: B018 (looked up, not called: not recorded)
        _ReadsInBackward.apply(x).sum().backward()
        x.detach() * 3  # computing on the values is no read
    assert [s.what for s in probe.found] == ["aten.nonzero.default", "Tensor.__bool__", "aten._local_scalar_dense.default", "Tensor.tolist"]
    assert "backward" in probe.found[-1].stack
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # unwrapped again


def _masked_select_permute(tokens, routing_map, probs):
    """The permutation's definition: expert by expert, each expert's tokens in token order."""
    mask = routing_map.T.contiguous()  # [experts, tokens]
    token_index = torch.arange(tokens.shape[0]).expand_as(mask)
    sorted_indices = token_index.masked_select(mask)
    return tokens[sorted_indices], probs.T.contiguous().masked_select(mask), sorted_indices


def _random_routing(tokens: int, experts: int, topk: int, seed: int, idle_experts: int):
    """A top-k routing map over `experts - idle_experts` experts (the rest get no token)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, torch.randperm(experts, generator=g)[:idle_experts]] = -1.0
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    return routing_map, probs


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("topk,experts,idle", [(1, 4, 2), (2, 8, 3), (4, 16, 5), (8, 16, 0)])
def test_megatron_dropless_permute_is_the_masked_select_order_without_syncs(tokens, topk, experts, idle):
    from megatron.core.transformer.moe import moe_utils

    routing_map, probs = _random_routing(tokens, experts, topk, seed=tokens * 100 + topk, idle_experts=idle)
    assert (routing_map.sum(0) == 0).sum() >= idle  # experts without tokens
    hidden = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(topk))
    with HostSyncProbe() as probe:
        permuted, permuted_probs, sorted_indices, _, _ = moe_utils.permute(
            hidden, routing_map, probs=probs, num_out_tokens=tokens * topk, fused=False, drop_and_pad=False
        )
        restored = moe_utils.unpermute(permuted, sorted_indices, hidden.shape, routing_map=routing_map, fused=False)
    assert not probe.found, probe.report()
    want, want_probs, want_indices = _masked_select_permute(hidden, routing_map, probs)
    assert torch.equal(sorted_indices, want_indices)
    assert torch.equal(permuted, want) and torch.equal(permuted_probs, want_probs)
    torch.testing.assert_close(restored, hidden * topk)  # every token comes back once per chosen expert


def test_expert_offsets_from_a_device_tensor_equal_those_from_the_host_list():
    from skyrl_megatron.model.moe.experts import expert_offsets

    counts = [3, 0, 5, 0, 2]
    from_list = expert_offsets(counts, torch.device("cpu"))
    from_tensor = expert_offsets(torch.tensor(counts), torch.device("cpu"))
    assert from_tensor.dtype == from_list.dtype == torch.int32
    assert torch.equal(from_tensor, from_list) and from_tensor.tolist() == [3, 3, 8, 8, 10]


def _layer_records(layers):
    """Forward hooks recording what each MoE layer's experts got and gave, and its permutation order."""
    records, handles = [], []
    for layer in layers:

        def on_experts(module, args, output, layer=layer):
            records.append(
                {
                    "tokens_per_expert": torch.as_tensor(args[1]).clone(),
                    "counts_were_tensor": isinstance(args[1], torch.Tensor),
                    "order": layer.token_dispatcher.reversed_local_input_permutation_mapping.clone(),
                    "expert_output": output[0].detach().clone(),
                }
            )

        handles.append(layer.experts.register_forward_hook(on_experts))
    return records, handles


def _both_paths(rank, world_size, hf_dir: str) -> dict:
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class, set_counts_on_device
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    spec = ModelSpec(
        hf_dir,
        parallel=parallel,
        dtype="fp32",
        wrap_with_ddp=True,
        ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True},
        transformer_overrides={"moe_grouped_gemm": True},
    )
    model = build_model(spec).chunks[0]
    layers = [m for m in model.modules() if isinstance(m, grouped_moe_layer_class())]
    out = {"dispatchers": sorted({type(layer.token_dispatcher).__name__ for layer in layers}), "layers": len(layers)}
    # dropless top-k: permuted and unpermuted by gathers (model/moe/token_permute.py)
    out["by_gathers"] = [hasattr(layer.token_dispatcher.dispatch_preprocess, "__wrapped__")
                         and hasattr(layer.token_dispatcher.combine_postprocess, "__wrapped__") for layer in layers]
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    for on in (False, True, False):  # the last run shows switching back restores the previous path
        assert set_counts_on_device(model, on) == len(layers)
        model.zero_grad_buffer()
        records, handles = _layer_records(layers)
        logits = model(tokens, positions, None)
        logits.float().square().mean().backward()
        for handle in handles:
            handle.remove()
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        out.setdefault("runs", []).append({"on": on, "logits": logits.detach().clone(), "grads": grads, "records": records})

    # one MoE layer alone, forward and backward, probed for host reads; 3 tokens at top-2 leave
    # at least two of the 8 experts without a token
    layer = layers[0]
    hidden_size = layer.config.hidden_size
    for name, shape in (("packed", (12, 2, hidden_size)), ("few_tokens", (3, 1, hidden_size))):
        g = torch.Generator().manual_seed(len(shape) + shape[0])
        hidden = torch.randn(*shape, generator=g)
        grad = torch.randn(*shape, generator=g)
        for on in (False, True):
            set_counts_on_device(model, on)
            x = hidden.clone().requires_grad_()
            records, handles = _layer_records([layer])
            with HostSyncProbe() as probe:
                output, _ = layer(x)
                output.backward(grad)
            for handle in handles:
                handle.remove()
            out.setdefault("layer", []).append(
                {"case": name, "on": on, "syncs": [s.what for s in probe.found], "report": probe.report(),
                 "output": output.detach().clone(), "input_grad": x.grad.clone(), "records": records}
            )
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("moe") / "hf"
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=3)
    return run_on_ranks(_both_paths, 1, str(hf_dir))[0]


def _assert_records_equal(got: list, want: list) -> None:
    assert len(got) == len(want) and got
    for a, b in zip(got, want):
        for key in ("tokens_per_expert", "order", "expert_output"):
            assert torch.equal(a[key], b[key]), key


def test_counts_stay_on_device_at_ep1_with_bitwise_the_same_model_results(paths):
    assert paths["dispatchers"] == ["DeviceCountsDispatcher"] and paths["layers"] == 4
    assert paths["by_gathers"] == [True] * 4
    previous, device, back = paths["runs"]
    for run in (device, back):
        assert torch.equal(run["logits"], previous["logits"])
        assert run["grads"].keys() == previous["grads"].keys()
        for name, grad in previous["grads"].items():
            assert torch.equal(run["grads"][name], grad), name
        _assert_records_equal(run["records"], previous["records"])
    assert any(torch.count_nonzero(g) for n, g in device["grads"].items() if ".experts." in n)
    assert [r["counts_were_tensor"] for r in device["records"]] == [True] * 4


def test_an_moe_layer_at_ep1_reads_nothing_on_the_host(paths):
    by = {(r["case"], r["on"]): r for r in paths["layer"]}
    for case in ("packed", "few_tokens"):
        previous, device = by[(case, False)], by[(case, True)]
        assert not device["syncs"], device["report"]
        assert previous["syncs"], "the probe sees the previous path's copy of the counts to the host"
        assert torch.equal(device["output"], previous["output"])
        assert torch.equal(device["input_grad"], previous["input_grad"])
        _assert_records_equal(device["records"], previous["records"])
    few = by[("few_tokens", True)]["records"][0]["tokens_per_expert"]
    assert (few == 0).sum() >= 2 and int(few.sum()) == 3 * 2


def test_grouped_linear_on_tensor_counts_reads_nothing_on_the_host_for_any_token_count():
    """Counts as a tensor: offsets summed where they lie, and the weight gradient's transposed operand
    (its last dimension the routed token count, here 9) still goes to the kernel, not the host loop."""
    from skyrl_megatron.model.moe.experts import grouped_linear

    counts = [3, 0, 5, 1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 16, generator=g)
    weights = [torch.randn(24, 16, generator=g) for _ in counts]
    grad_out = torch.randn(sum(counts), 24, generator=g)
    results = []
    for tokens_per_expert in (counts, torch.tensor(counts)):
        inputs = [x.clone().requires_grad_(), *(w.clone().requires_grad_() for w in weights)]
        with HostSyncProbe() as probe:
            out = grouped_linear(inputs[0], tokens_per_expert, inputs[1:])
            out.backward(grad_out)
        results.append((out.detach(), [t.grad for t in inputs], probe.found))
    (list_out, list_grads, _), (out, grads, found) = results
    assert not found, "\n".join(s.what + "\n" + s.stack for s in found)
    assert torch.equal(out, list_out) and all(torch.equal(a, b) for a, b in zip(grads, list_grads))


def _dispatchers(rank, world_size, hf_dir: str, expert: int, overrides: dict) -> list[str]:
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(expert=expert)
    initialize_model_parallel(parallel)
    spec = ModelSpec(hf_dir, parallel=parallel, dtype="fp32", transformer_overrides={"moe_grouped_gemm": True, **overrides})
    model = build_model(spec).chunks[0]
    layers = [m for m in model.modules() if isinstance(m, grouped_moe_layer_class())]
    names = sorted({type(layer.token_dispatcher).__name__ for layer in layers}) if layers else []
    return names, sorted({hasattr(layer.token_dispatcher.dispatch_preprocess, "__wrapped__") for layer in layers})


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,expert,overrides,by_gathers",
    [(2, 2, {}, True), (1, 1, {"moe_expert_capacity_factor": 1.0}, False)],
    ids=["EP2", "capacity_factor"],
)
def test_every_other_case_keeps_megatrons_dispatcher(tmp_path, world, expert, overrides, by_gathers):
    """Where a collective needs host split sizes (EP2) or sizes depend on the data (token dropping);
    permutation by gathers wherever routing stays dropless top-k (EP2), not where tokens may drop."""
    hf_dir = tmp_path / "hf"
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=3)
    for names, gathers in run_on_ranks(_dispatchers, world, str(hf_dir), expert, overrides):
        assert names == ["MoEAlltoAllTokenDispatcher"] and gathers == [by_gathers]
