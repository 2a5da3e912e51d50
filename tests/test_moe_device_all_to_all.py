"""``moe_config.device_all_to_all``: MoE layers at EP2 whose all-to-alls take their sizes on the device
(model/moe/exchange_dispatcher.py), on CPU over gloo with the NVSHMEM op's stand-in.

A tiny Qwen3-MoE at EP2 (2 ranks, each its own tokens) gives bitwise the same logits and gradients
(expert weights included) with the key on as with Megatron's dispatcher, also under full-layer and
MoE-module activation recompute; one MoE layer alone, with
so few tokens that experts get none, the same output and input gradient, and no host read but the
stand-in transport's own. Then the config checks that refuse the key where it cannot apply.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.host_syncs import HostSyncProbe


def _run(model, tokens, positions):
    model.zero_grad_buffer()
    logits = model(tokens, positions, None)
    logits.float().square().mean().backward()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach().clone(), grads


def _layer_run(layer, hidden, grad):
    x = hidden.clone().requires_grad_()
    tokens_per_expert = []
    handle = layer.experts.register_forward_hook(lambda m, args, out: tokens_per_expert.append(torch.as_tensor(args[1]).clone()))
    with HostSyncProbe() as probe:
        output, _ = layer(x)
        output.backward(grad)
    handle.remove()
    return output.detach().clone(), x.grad.clone(), probe.found, tokens_per_expert[0]


def _both_dispatchers(rank, world_size, hf_dir: str) -> dict:
    from skyrl_megatron.config import ConfigError, MoeSettings
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class, use_device_all_to_all
    from skyrl_megatron.model.moe.settings import dispatch_needs_equal_token_counts
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(expert=2)
    initialize_model_parallel(parallel)

    def build(on: bool, grouped: bool = True, recompute: dict | None = None):
        spec = ModelSpec(hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True,
                         ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True},
                         transformer_overrides={"moe_grouped_gemm": grouped, **(recompute or {})},
                         moe=MoeSettings(device_all_to_all=on))
        model = build_model(spec).chunks[0]
        return model, [m for m in model.modules() if isinstance(m, grouped_moe_layer_class())]

    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5 + rank))  # each rank its own
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    out = {}
    megatron_model, megatron_layers = build(False)
    device_model, device_layers = build(True)
    out["dispatchers"] = [sorted({type(layer.token_dispatcher).__name__ for layer in layers})
                          for layers in (megatron_layers, device_layers)]
    # the micro-batch planner gives the EP ranks one shape (the buffers are sized by it)
    out["equal_token_counts"] = [dispatch_needs_equal_token_counts([m]) for m in (megatron_model, device_model)]
    out["by_gathers"] = [hasattr(layer.token_dispatcher.dispatch_preprocess, "__wrapped__") for layer in device_layers]
    out["megatron"] = _run(megatron_model, tokens, positions)
    out["device"] = _run(device_model, tokens, positions)
    out["device_again"] = _run(device_model, tokens, positions)  # reused buffers and plans

    # under activation recompute the layers' exchanges run again inside the backward
    for name, recompute in (("full", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
                            ("moe", {"recompute_granularity": "selective", "recompute_modules": ["moe"]})):
        out[f"recompute_{name}"] = _run(build(True, recompute=recompute)[0], tokens, positions)

    # the hook on a model built without the key swaps the same way
    use_device_all_to_all([megatron_model])
    out["swapped"] = _run(megatron_model, tokens, positions)

    # one layer alone; 3 tokens at top-2 leave experts of 8 without a token on some rank
    hidden_size = device_layers[0].config.hidden_size
    g = torch.Generator().manual_seed(11 + rank)
    hidden, grad = torch.randn(3, 1, hidden_size, generator=g), torch.randn(3, 1, hidden_size, generator=g)
    megatron_layer = build(False)[1][0]
    out["layer"] = {"megatron": _layer_run(megatron_layer, hidden, grad), "device": _layer_run(device_layers[0], hidden, grad)}

    # per-expert modules (not grouped): the build refuses the key, naming it
    try:
        build(True, grouped=False)
        out["refused"] = None
    except ConfigError as error:
        out["refused"] = str(error)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("moe") / "hf"
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=3)
    return run_on_ranks(_both_dispatchers, 2, str(hf_dir))


def _assert_same(got, want):
    logits, grads = got
    want_logits, want_grads = want
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.slow
def test_ep2_with_the_key_on_equals_megatrons_dispatcher_bitwise(results):
    for r in results:
        assert r["dispatchers"] == [["MoEAlltoAllTokenDispatcher"], ["DeviceAllToAllDispatcher"]]
        assert r["by_gathers"] == [True] * len(r["by_gathers"]) and r["by_gathers"]
        assert r["equal_token_counts"] == [False, True]
        for run in ("device", "device_again", "swapped", "recompute_full", "recompute_moe"):
            _assert_same(r[run], r["megatron"])
        assert any(torch.count_nonzero(g) for n, g in r["device"][1].items() if ".experts." in n)
    assert not torch.equal(results[0]["device"][0], results[1]["device"][0])  # the ranks had their own tokens


@pytest.mark.slow
def test_one_layer_with_idle_experts_reads_nothing_on_the_host_but_the_stand_in_transport(results):
    idle = 0
    for r in results:
        want_out, want_grad, megatron_syncs, want_counts = r["layer"]["megatron"]
        out, grad, syncs, counts = r["layer"]["device"]
        assert torch.equal(out, want_out) and torch.equal(grad, want_grad)
        assert torch.equal(counts, want_counts)
        idle += int((counts == 0).sum())
        assert megatron_syncs, "the probe sees Megatron's copy of the split sizes to the host"
        others = [s for s in syncs if "row_exchange.py" not in s.stack.strip().splitlines()[-2]]
        assert not others, "\n".join(s.what + "\n" + s.stack for s in others)
        assert syncs, "the stand-in transport reads its split sizes on the host (NVSHMEM does not)"
    assert idle > 0


@pytest.mark.slow
def test_the_build_refuses_the_key_for_moe_layers_it_cannot_serve(results):
    for r in results:
        assert r["refused"] and "moe_config.device_all_to_all" in r["refused"], r["refused"]
        assert "not our grouped MoE layer" in r["refused"] and "device_all_to_all=false" in r["refused"]


# ----- the config checks --------------------------------------------------------------------------


def _problems(overrides: dict) -> list:
    from omegaconf import OmegaConf

    from skyrl_megatron.config import check_megatron_role

    megatron = {"expert_model_parallel_size": 2, "moe_config": {"device_all_to_all": True}}
    cfg = OmegaConf.create({
        "trainer": {"policy": {"model": {"lora": {"rank": 0}}, "megatron_config": megatron},
                    "placement": {"policy_num_nodes": 1, "policy_num_gpus_per_node": 2}},
        "generator": {},
    })
    cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    return [p for p in check_megatron_role(cfg, "policy", None) if "device_all_to_all" in p.key]


def test_the_key_is_accepted_where_it_applies_and_off_by_default():
    from skyrl_megatron.config import MoeSettings

    assert MoeSettings().device_all_to_all is False
    assert _problems({}) == []


@pytest.mark.parametrize("overrides,words", [
    ({"trainer": {"policy": {"megatron_config": {"moe_config": {"token_dispatcher": "allgather"}}}}}, "token_dispatcher=alltoall"),
    ({"trainer": {"policy": {"megatron_config": {"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 1}}}},
     "expert_tensor_parallel_size=1"),
    ({"trainer": {"policy": {"megatron_config": {"transformer_config_kwargs": {"moe_expert_capacity_factor": 1.0}}}}},
     "moe_expert_capacity_factor"),
    ({"trainer": {"policy": {"megatron_config": {"transformer_config_kwargs": {"moe_grouped_gemm": False}}}}}, "moe_grouped_gemm"),
    ({"trainer": {"policy": {"model": {"lora": {"rank": 8}}}}}, "LoRA"),
    ({"trainer": {"policy": {"megatron_config": {"moe_config": {"device_all_to_all": "yes"}}}}}, "true or false"),
], ids=["dispatcher", "expert_tp", "dropping", "not_grouped", "lora", "not_bool"])
def test_the_key_is_refused_where_it_cannot_apply_naming_the_key_and_fix(overrides, words):
    problems = _problems(overrides)
    assert problems, "expected a problem"
    assert all(p.key.endswith("moe_config.device_all_to_all") for p in problems)
    assert any(words in str(p) for p in problems), [str(p) for p in problems]
