"""MoE settings (``megatron_config.moe_config``) and router metrics, on a tiny Qwen3-MoE (CPU, gloo, fp32).

Config rules and the settings mapping run in-process. Training runs through the real runner
(`policy_steps`) in two spawns of ranks: world-1 (the references, a direct count of the router's
top-k choices, capacity dropping, activation recompute, transformer_config_kwargs precedence) and
world-4 (EP2, TP2 x EP2, PP2 x EP2 with recompute, router freezing). Every layout must reproduce the
world-1 losses and router metrics under both the alltoall and the allgather dispatcher.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from skyrl_megatron.config import ConfigError, MegatronWorkerConfig, MoeSettings
from skyrl_megatron.model.moe.settings import moe_transformer_settings
from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.policy_steps import policy_steps
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"
ROWS, PROMPT, RESPONSE, SEED = 8, 6, 6, 5  # policy_steps' batch
STEPS = 2
PADDED = {"micro_batch_size": 3}
PACKED = {"max_tokens": 30}
ONE_PACKED_MICRO_BATCH = {"max_tokens": 10_000}  # world-1 packing adds no padding: the router sees only real tokens
# each parallel run pairs a dispatcher with a micro-batching (world-1 references: both dispatchers
# compute the same thing there); the packed runs under TP2 x SP carry alignment padding
PARALLEL_RUNS = {"padded": ("alltoall", PADDED), "packed": ("allgather", PACKED)}
CAPACITY_FACTOR = 1.0
AUX_LOSS_COEFF = 0.1
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
TRAIN_RTOL = 1e-5
LAYERS, EXPERTS, TOPK = 4, 8, 2  # the tiny Qwen3-MoE


def problems_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


# ---------------------------------------------------------------- config rules


def test_moe_config_defaults_reach_every_role_typed(compose):
    from skyrl_megatron.hosts import current

    cfg = current().our_view(compose())  # what our workers read, on either host
    for role in ("policy", "ref", "critic"):
        typed = MegatronWorkerConfig.from_host_config(cfg, role).moe_config
        assert typed == MoeSettings()
    assert MoeSettings().aux_loss_coeff == 0.0 and MoeSettings().router_dtype == "fp32"
    assert MoeSettings().token_dispatcher == "alltoall"


def test_unknown_moe_key_names_the_closest(compose, hf_config_dir):
    path = hf_config_dir("qwen3_moe")
    msg = problems_of(compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config.dispatcher=allgather"))
    assert f"{MC}.moe_config.dispatcher: unknown key" in msg and "did you mean 'token_dispatcher'" in msg
    with pytest.raises(ConfigError, match="moe_config.freeze_routers: unknown key.*did you mean 'freeze_router'"):
        MegatronWorkerConfig.from_mapping({"moe_config": {"freeze_routers": True}})
    msg = problems_of(compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config=fast"))
    assert f"{MC}.moe_config: must be a mapping, got 'fast'" in msg


def test_bad_moe_values_are_reported_together_each_with_its_key(compose, hf_config_dir):
    path = hf_config_dir("qwen3_moe")
    msg = problems_of(
        compose(
            f"trainer.policy.model.path={path}",
            f"{MC}.moe_config.token_dispatcher=alltoal",
            f"{MC}.moe_config.router_dtype=bf16",
            f"{MC}.moe_config.load_balancing_type=aux",
            f"{MC}.moe_config.aux_loss_coeff=-0.1",
            f"{MC}.moe_config.expert_bias_update_rate=-1",
            f"{MC}.moe_config.freeze_router=maybe",
        )
    )
    assert "(6 problems)" in msg
    assert f"{MC}.moe_config.token_dispatcher: unknown value 'alltoal'" in msg and "did you mean 'alltoall'" in msg
    assert f"{MC}.moe_config.router_dtype: unknown value 'bf16'. Fix: use one of fp32, fp64 or null" in msg
    assert f"{MC}.moe_config.load_balancing_type: unknown value 'aux'" in msg
    assert f"{MC}.moe_config.aux_loss_coeff: must be a number >= 0, got -0.1" in msg
    assert f"{MC}.moe_config.expert_bias_update_rate: must be a number >= 0, got -1" in msg
    assert f"{MC}.moe_config.freeze_router: must be true or false, got 'maybe'" in msg


def test_aux_loss_needs_an_aux_loss_balancing_type(compose, hf_config_dir):
    path = hf_config_dir("qwen3_moe")
    msg = problems_of(
        compose(
            f"trainer.policy.model.path={path}",
            f"{MC}.moe_config.load_balancing_type=sinkhorn",
            f"{MC}.moe_config.aux_loss_coeff=0.01",
        )
    )
    assert f"{MC}.moe_config.aux_loss_coeff: an auxiliary loss (0.01) needs an aux-loss load-balancing type" in msg


def test_flex_dispatcher_without_deepep_names_the_key_and_the_fix(compose, hf_config_dir):
    moe = compose(f"trainer.policy.model.path={hf_config_dir('qwen3_moe')}", f"{MC}.moe_config.token_dispatcher=flex")
    msg = problems_of(moe)
    assert f"{MC}.moe_config.token_dispatcher: the flex dispatcher with backend 'deepep' needs deep_ep" in msg
    assert "install DeepEP on every worker node, or set token_dispatcher to alltoall or allgather" in msg
    # the build checks again (a worker node may differ from the node that validated)
    provider = SimpleNamespace(num_moe_experts=8, moe_router_enable_expert_bias=False)
    with pytest.raises(ConfigError, match=r"megatron_config\.moe_config\.token_dispatcher: the flex dispatcher"):
        moe_transformer_settings(provider, MoeSettings(token_dispatcher="flex", flex_backend="hybridep"), {})


def test_dense_model_ignores_the_moe_section(compose, hf_config_dir):
    dense = compose(
        f"trainer.policy.model.path={hf_config_dir('qwen3')}",
        f"{MC}.moe_config.token_dispatcher=flex",
        f"{MC}.moe_config.freeze_router=true",
    )
    validate_config(dense)  # must not raise
    assert moe_transformer_settings(SimpleNamespace(num_moe_experts=None), MoeSettings(token_dispatcher="flex"), {}) == {}


def test_settings_map_onto_transformer_config_fields():
    provider = SimpleNamespace(num_moe_experts=8, moe_router_enable_expert_bias=True, moe_router_load_balancing_type="aux_loss")
    settings = MoeSettings(
        token_dispatcher="allgather",
        router_dtype="fp64",
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=0.01,
        expert_bias=True,
        expert_bias_update_rate=1e-3,
    )
    assert moe_transformer_settings(provider, settings, {}) == {
        "moe_token_dispatcher_type": "allgather",
        "moe_router_dtype": "fp64",
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.01,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-3,
    }
    # null keeps the checkpoint's balancing type and expert bias: no field is written
    defaults = moe_transformer_settings(provider, MoeSettings(router_dtype=None), {})
    assert "moe_router_load_balancing_type" not in defaults and "moe_router_enable_expert_bias" not in defaults
    assert defaults["moe_router_dtype"] is None and defaults["moe_aux_loss_coeff"] == 0.0


@pytest.mark.parametrize("checkpoint_has_bias,asked", [(False, True), (True, False)])
def test_expert_bias_must_match_the_checkpoint(checkpoint_has_bias, asked):
    provider = SimpleNamespace(num_moe_experts=8, moe_router_enable_expert_bias=checkpoint_has_bias)
    with pytest.raises(ConfigError, match=r"moe_config\.expert_bias: the checkpoint routes with(out)? .*leave expert_bias null"):
        moe_transformer_settings(provider, MoeSettings(expert_bias=asked), {})


# ---------------------------------------------------------------- rank functions


def _direct_expert_counts(chunks) -> torch.Tensor:
    """[layers, experts]: the router's top-k choices for the batch's real tokens, one unpadded row at a time."""
    from skyrl_megatron.model.moe.settings import routers

    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=SEED)
    counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.long)

    def record(router, args, output):
        routing_map = output[1]
        assert bool((routing_map.sum(dim=1) == TOPK).all()), "every token chooses exactly top-k experts"
        counts[router.layer_number - 1] += routing_map.sum(dim=0).cpu()

    handles = [router.register_forward_hook(record) for _, router in routers(chunks)]
    model = chunks[0]
    model.eval()
    with torch.no_grad():
        for sequence, mask in zip(batch["sequences"], batch["attention_mask"]):
            ids = sequence[mask.bool()].unsqueeze(0)
            model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
    for handle in handles:
        handle.remove()
    return counts


def _router_and_expert_weights(chunks) -> dict:
    """Router weights and one expert's weight: (value, requires_grad, has a DDP grad buffer)."""
    picked = {}
    for name, param in chunks[0].named_parameters():
        if ".router." in name or name.endswith("experts.linear_fc1.weight0"):
            picked[name] = (param.detach().clone(), param.requires_grad, hasattr(param, "main_grad"))
    return picked


def _provider_fields(hf_dir: str, moe: MoeSettings, transformer_overrides: dict) -> dict:
    """The finalised TransformerConfig's MoE values for these settings."""
    from skyrl_megatron.model.build import ModelSpec, load_bridge, make_provider

    spec = ModelSpec(hf_dir, dtype="fp32", moe=moe, transformer_overrides=transformer_overrides)
    provider = make_provider(spec, load_bridge(hf_dir))
    names = ("moe_token_dispatcher_type", "moe_router_dtype", "moe_aux_loss_coeff", "moe_router_bias_update_rate")
    return {name: getattr(provider, name) for name in names}


def _world1(rank, world_size, hf_dir) -> dict:
    runs = {
        "padded": policy_steps(
            rank, world_size, hf_dir, {}, PADDED, steps=STEPS, router_metrics=True, inspect=_direct_expert_counts
        ),
        "packed": policy_steps(rank, world_size, hf_dir, {}, PACKED, steps=STEPS, router_metrics=True),
    }
    runs["recompute"] = policy_steps(
        rank, world_size, hf_dir, {}, PADDED, steps=STEPS, router_metrics=True,
        spec_overrides={"transformer_overrides": RECOMPUTE},
    )
    for name, pad in (("capacity", False), ("capacity_padded", True)):
        capacity = {"moe_expert_capacity_factor": CAPACITY_FACTOR, "moe_pad_expert_input_to_capacity": pad}
        runs[name] = policy_steps(
            rank, world_size, hf_dir, {}, ONE_PACKED_MICRO_BATCH, steps=1, router_metrics=True,
            spec_overrides={"transformer_overrides": capacity},
        )
    runs["aux_loss"] = policy_steps(
        rank, world_size, hf_dir, {}, PADDED, steps=1, spec_overrides={"moe": MoeSettings(aux_loss_coeff=AUX_LOSS_COEFF)}
    )
    runs["defaults"] = _provider_fields(hf_dir, MoeSettings(), {})
    runs["precedence"] = _provider_fields(
        hf_dir,
        MoeSettings(token_dispatcher="allgather", router_dtype="fp32", aux_loss_coeff=0.0),
        {"moe_router_dtype": "fp64", "moe_aux_loss_coeff": 0.02},
    )
    return runs


def _runs(rank, world_size, hf_dir, plan: dict) -> dict:
    """Every run of `plan` (name -> layout, micro-batching, ModelSpec overrides, inspect) in one spawn."""
    return {
        name: policy_steps(
            rank, world_size, hf_dir, layout, batching, steps=STEPS, router_metrics=True,
            spec_overrides=overrides, inspect=probe,
        )
        for name, (layout, batching, overrides, probe) in plan.items()
    }


# ---------------------------------------------------------------- training and metrics


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny_hf_model("qwen3_moe", out, seed=11)
    return str(out)


@pytest.fixture(scope="module")
def world1(moe_model) -> dict:
    (runs,) = run_on_ranks(_world1, 1, moe_model, timeout=600)
    return runs


def _moe_metrics(step: dict) -> dict[str, float]:
    return {k: v for k, v in step.items() if k.startswith("moe/")}


def _expected_metrics(loads: torch.Tensor, chosen_per_layer: float) -> dict[str, float]:
    """The router metrics from per-layer expert loads [layers, experts] and top-k choices per layer."""
    expected, imbalances = {}, []
    for layer, row in enumerate(loads.double()):
        imbalance = float(row.max() / row.mean())
        expected[f"moe/layer_{layer}/load_imbalance"] = imbalance
        expected[f"moe/layer_{layer}/dropped_token_fraction"] = (chosen_per_layer - float(row.sum())) / chosen_per_layer
        imbalances.append(imbalance)
    expected["moe/max_load_imbalance"] = max(imbalances)
    expected["moe/dropped_token_fraction"] = (chosen_per_layer * len(loads) - float(loads.sum())) / (chosen_per_layer * len(loads))
    return expected


def _assert_metrics_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: metric names differ"
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), f"{what} {name}: {got[name]} vs {value}"


def _assert_same_training(run: dict, reference: dict, what: str) -> None:
    assert len(run["history"]) == len(reference["history"]) == STEPS
    for step, (got, want) in enumerate(zip(run["history"], reference["history"])):
        for metric in ("final_loss", "policy_loss", "grad_norm"):
            assert got[metric] == pytest.approx(want[metric], rel=TRAIN_RTOL, abs=1e-7), (
                f"{what} step {step} {metric}: {got[metric]} vs world-1 {want[metric]}"
            )
        _assert_metrics_equal(_moe_metrics(got), _moe_metrics(want), f"{what} step {step}")


@pytest.mark.slow
def test_world1_metrics_equal_the_routers_top_k_choices(world1):
    counts = world1["padded"]["inspected"][0]
    real_tokens = int(make_rl_batch(ROWS, PROMPT, RESPONSE, seed=SEED)["attention_mask"].sum())
    assert int(counts.sum()) == LAYERS * real_tokens * TOPK
    expected = _expected_metrics(counts, real_tokens * TOPK)
    assert expected["moe/max_load_imbalance"] > 1.2, "the test model should route unevenly"
    assert expected["moe/dropped_token_fraction"] == 0.0
    # padded micro-batches (padding rows and columns), packed ones, and activation recompute (which
    # runs every router twice) all count each real token once
    for name in ("padded", "packed", "recompute"):
        _assert_metrics_equal(_moe_metrics(world1[name]["history"][0]), expected, f"world-1 {name} step 0")
    for name in ("packed", "recompute"):
        _assert_same_training(world1[name], world1["padded"], f"world-1 {name}")
    # the router trains: its choices, and with them the metrics, move after the first steps
    assert world1["padded"]["history"][-1]["moe/max_load_imbalance"] != expected["moe/max_load_imbalance"]


@pytest.mark.slow
def test_capacity_factor_drops_the_excess_choices(world1):
    counts = world1["padded"]["inspected"][0]
    real_tokens = int(counts[0].sum()) // TOPK
    chosen = real_tokens * TOPK
    # Megatron's capacity per expert over one micro-batch of only real tokens
    capacity = math.ceil(chosen / EXPERTS * CAPACITY_FACTOR)
    got = _moe_metrics(world1["capacity"]["history"][0])
    # the first layer routes what it would without capacity and keeps at most `capacity` per expert;
    # later layers see hidden states changed by the drops, so only the bound holds there
    first = _expected_metrics(counts[:1].clamp(max=capacity), chosen)
    for name in ("load_imbalance", "dropped_token_fraction"):
        assert got[f"moe/layer_0/{name}"] == pytest.approx(first[f"moe/layer_0/{name}"], rel=1e-12)
    assert got["moe/layer_0/dropped_token_fraction"] > 0, "the capacity factor should drop some choices"
    per_layer_dropped = [got[f"moe/layer_{i}/dropped_token_fraction"] for i in range(LAYERS)]
    for layer, dropped in enumerate(per_layer_dropped):
        received = chosen * (1 - dropped)
        busiest = got[f"moe/layer_{layer}/load_imbalance"] * received / EXPERTS
        assert busiest <= capacity + 1e-9, f"layer {layer}: an expert got {busiest} tokens, capacity {capacity}"
    assert got["moe/dropped_token_fraction"] == pytest.approx(sum(per_layer_dropped) / LAYERS, rel=1e-12)
    # padding expert inputs to capacity adds empty slots to the routing map; they are not load
    _assert_metrics_equal(_moe_metrics(world1["capacity_padded"]["history"][0]), got, "padded to capacity")


@pytest.mark.slow
def test_transformer_config_kwargs_win_over_moe_config(world1):
    # the defaults replace the bridge's Qwen3-MoE values (aux loss 1e-3, router in the model's dtype)
    assert world1["defaults"] == {
        "moe_token_dispatcher_type": "alltoall",
        "moe_router_dtype": "fp32",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_bias_update_rate": 0.0,
    }
    assert world1["precedence"] == {
        "moe_token_dispatcher_type": "allgather",  # from moe_config
        "moe_router_dtype": "fp64",  # transformer_config_kwargs over moe_config's fp32
        "moe_aux_loss_coeff": 0.02,  # transformer_config_kwargs over moe_config's 0
        "moe_router_bias_update_rate": 0.0,  # moe_config's RL default over Megatron's 1e-3
    }


@pytest.mark.slow
def test_aux_loss_is_off_by_default_and_trains_when_set(world1):
    # the load-balancing loss is not part of the reported policy loss, but its gradient reaches the
    # routers and the layers below them
    off, on = world1["padded"]["history"][0], world1["aux_loss"]["history"][0]
    assert on["final_loss"] == pytest.approx(off["final_loss"], rel=1e-6)
    assert abs(on["grad_norm"] - off["grad_norm"]) > 1e-4 * off["grad_norm"]


WORLD = 4
LAYOUTS = {  # at world 4: EP2 with DP4, TP2 x EP2 with DP2
    "ep2": {"expert": 2},
    "tp2_ep2": {"tensor": 2, "expert": 2, "sequence_parallel": True},
}
# PP2's one-forward-one-backward schedule recomputes a micro-batch after a later one ran forward
PP2_EP2 = {"pipeline": 2, "expert": 2}


def _world4_plan() -> dict:
    plan = {
        f"{layout}_{name}": (parallel, batching, {"moe": MoeSettings(token_dispatcher=dispatcher)}, None)
        for layout, parallel in LAYOUTS.items()
        for name, (dispatcher, batching) in PARALLEL_RUNS.items()
    }
    plan["pp2_ep2_recompute"] = (PP2_EP2, PADDED, {"transformer_overrides": RECOMPUTE}, None)
    plan["frozen"] = (LAYOUTS["tp2_ep2"], PADDED, {"moe": MoeSettings(freeze_router=True)}, _router_and_expert_weights)
    # the all-to-alls with their sizes on the device (CPU: the NVSHMEM op's gloo stand-in), through the
    # runner's packing (EP ranks given one micro-batch shape) and PP2's schedule with recompute
    device = MoeSettings(device_all_to_all=True)
    plan["ep2_device_packed"] = (LAYOUTS["ep2"], PACKED, {"moe": device}, None)
    plan["pp2_ep2_device_recompute"] = (PP2_EP2, PADDED, {"moe": device, "transformer_overrides": RECOMPUTE}, None)
    return plan


@pytest.fixture(scope="module")
def world4(moe_model) -> list[dict]:
    return run_on_ranks(_runs, WORLD, moe_model, _world4_plan(), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_world1_losses_and_router_metrics(world1, world4, layout):
    for name, (dispatcher, _) in PARALLEL_RUNS.items():
        histories = [runs[f"{layout}_{name}"]["history"] for runs in world4]
        what = f"{layout} {dispatcher} {name}"
        assert all(h == histories[0] for h in histories), f"{what}: ranks disagree on the metrics"
        _assert_same_training(world4[0][f"{layout}_{name}"], world1[name], what)


@pytest.mark.slow
def test_pipeline_stages_with_recompute_count_each_token_once(world1, world4):
    # layers 0-1 and 2-3 live on different stages; a router recomputed in the backward pass must
    # neither count again nor take the real-token mask of the micro-batch that ran forward last
    histories = [runs["pp2_ep2_recompute"]["history"] for runs in world4]
    assert all(h == histories[0] for h in histories)
    _assert_same_training(world4[0]["pp2_ep2_recompute"], world1["recompute"], "pp2 x ep2 with recompute")


@pytest.mark.slow
def test_device_all_to_all_matches_world1_packed_and_under_pipeline_recompute(world1, world4):
    for run, reference in (("ep2_device_packed", "packed"), ("pp2_ep2_device_recompute", "recompute")):
        histories = [runs[run]["history"] for runs in world4]
        assert all(h == histories[0] for h in histories), f"{run}: ranks disagree on the metrics"
        _assert_same_training(world4[0][run], world1[reference], run)


@pytest.mark.slow
def test_frozen_router_keeps_its_weights_while_experts_train(world1, world4):
    for rank, runs in enumerate(world4):
        before, after = runs["frozen"]["inspected"]
        routers = [name for name in before if ".router." in name]
        experts = [name for name in before if name not in routers]
        assert len(routers) == LAYERS and experts, f"rank {rank}: expected router and expert weights"
        for name in routers:
            value, requires_grad, has_grad_buffer = after[name]
            assert not requires_grad and not has_grad_buffer, f"rank {rank} {name}: still trains"
            assert torch.equal(value, before[name][0]), f"rank {rank} {name}: a frozen router weight changed"
        for name in experts:
            value, requires_grad, has_grad_buffer = after[name]
            assert requires_grad and has_grad_buffer
            assert not torch.equal(value, before[name][0]), f"rank {rank} {name}: the expert did not train"
    frozen, trained = world4[0]["frozen"]["history"][0], world1["padded"]["history"][0]
    # same weights, same forward; the gradient norm lacks only the router's share
    assert frozen["final_loss"] == pytest.approx(trained["final_loss"], rel=TRAIN_RTOL)
    assert frozen["grad_norm"] < trained["grad_norm"]
