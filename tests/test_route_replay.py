"""MoE routing replay (``moe_config.routing_replay: r2``) on a tiny Qwen3-MoE (CPU, gloo, fp32).

In-process: routes kept per row survive re-padding and reordering, the host <-> model layout maps
put a token's routes where the token goes, and the config rules. Spawned ranks: a constructed
routing flip (below) makes the first training step's importance ratio differ from 1 without
replay; with replay it is exactly 1 (every token's log-prob bitwise the scored one, ppo_kl exactly
0) at world 1, EP2, TP2 x EP2 (SP; alltoall and allgather), TP2 x ETP1 x EP2, PP2 x EP2 and
PP2 x VPP2 with activation recompute, and CP2, and the routes a
pass replays are bitwise the ones scoring recorded, also when scoring used another micro-batch plan.
R3: the HF engine (the host-free core of our CPU/GPU engines) reports the experts its tokens went through; scoring replays them bitwise and
training's first-step ratio is exactly 1 (world 1; PP2 x EP2 and PP2 x VPP2 with recompute, where each
stage and chunk takes its layers; TP2 x EP2 with SP and CP2, where they split like their tokens).
Through skyrl 0.4's trainer: tests/host04; skyrl-train 0.3.1 refusing r3: tests/host03.

The flip: two passes over the same tokens can pick different experts where router logits are
near-tied (a kernel, dtype or batch composition moves a logit by an ulp). `_ScoringFlip` makes that
happen on every token, deterministically: scoring (no grad) takes the 1st..(k-1)-th and the
(k+1)-th expert, training the top k; the routing probabilities come from the router's own logits at
the chosen experts either way, as in a real near-tie.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.compute.microbatch.pack import pack
from skyrl_megatron.compute.microbatch.plan import PackingSettings, layout_micro_batch
from skyrl_megatron.compute.microbatch.rows import HostRows
from skyrl_megatron.compute.route_replay import NO_ROUTE, RouteStore, host_columns
from skyrl_megatron.config import ConfigError, MoeSettings
from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.policy_steps import policy_steps
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"
PADDED = {"micro_batch_size": 3}
PACKED = {"max_tokens": 30}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def problems_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


# ---------------------------------------------------------------- routes per row


def _routes_for(batch, layers=2, k=2, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (*batch["sequences"].shape, layers, k), generator=g)


def test_routes_follow_their_rows_through_reordering_and_repadding():
    batch = make_rl_batch(5, 4, 4, seed=1)
    routes = _routes_for(batch)
    store = RouteStore()
    store.put(batch["sequences"], batch["attention_mask"], routes)
    # the trainer's rows: reordered, with two more padding columns on the left
    order = torch.tensor([3, 0, 4, 1, 2])
    sequences = torch.nn.functional.pad(batch["sequences"][order], (2, 0))
    mask = torch.nn.functional.pad(batch["attention_mask"][order], (2, 0))
    got = host_columns(store.lookup(sequences, mask), mask)
    real = mask.bool()
    assert torch.equal(got[real], routes[order][batch["attention_mask"][order].bool()].to(got.dtype))
    assert bool((got[~real] == NO_ROUTE).all())


def test_identical_rows_get_their_routes_in_order_and_an_unscored_row_is_named():
    batch = make_rl_batch(2, 4, 4, seed=2)
    sequences = torch.cat([batch["sequences"][:1]] * 2)
    mask = torch.cat([batch["attention_mask"][:1]] * 2)
    routes = _routes_for({"sequences": sequences}, seed=3)
    store = RouteStore()
    store.put(sequences, mask, routes)
    first, second = store.lookup(sequences, mask)
    assert torch.equal(first.long(), routes[0][mask[0].bool()]) and torch.equal(second.long(), routes[1][mask[1].bool()])
    with pytest.raises(KeyError, match="row 1 of the training batch was not scored"):
        store.lookup(batch["sequences"], batch["attention_mask"])


@pytest.mark.parametrize("packed", [False, True])
def test_model_layout_puts_routes_where_their_tokens_go(packed):
    batch = make_rl_batch(4, 5, 5, seed=4)
    settings = PackingSettings(packed=packed, tensor=2, sequence_parallel=True, context=2)  # alignment padding
    rows = HostRows.from_batch(batch["sequences"], batch["attention_mask"])
    layout = layout_micro_batch(torch.arange(4), rows.spans.length.tolist(), settings)
    # a "route" equal to the token id lands exactly on the token
    as_routes = batch["sequences"].unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 3, 2)
    laid_out = pack(rows, layout, routes=as_routes, with_routes=True)
    inputs, model = laid_out.inputs, laid_out.routes
    real = model[..., 0, 0] != NO_ROUTE
    assert torch.equal(laid_out.padding, ~real)  # what is not a real token is padding, and routed fixedly
    assert int(real.sum()) == int(batch["attention_mask"].sum())
    assert torch.equal(model[..., 0, 0][real], inputs.input_ids[real])
    back = inputs.to_host_layout(model, NO_ROUTE)
    mask = batch["attention_mask"].bool()
    assert torch.equal(back[mask], as_routes[mask]) and bool((back[~mask] == NO_ROUTE).all())


def test_engine_routes_take_each_route_layers_column_and_leave_unrouted_tokens_to_choose():
    """R3 input: an engine reports one column per MoE layer (ours) or per decoder layer (vLLM, dense
    layers included); tokens past its routes (a row's last) get NO_ROUTE."""
    from types import SimpleNamespace

    from skyrl_megatron.compute.route_replay import engine_routes

    # decoder layers 1..4, MoE at 2 and 4; this rank holds both routers
    replay = SimpleNamespace(rollout_columns=[0, 1], decoder_columns=[1, 3], moe_layer_count=2, topk=2,
                             config=SimpleNamespace(num_layers=4))
    mask = torch.tensor([[0, 1, 1, 1]])
    routed = [torch.tensor([True, True, False])]
    per_decoder_layer = torch.arange(3 * 4 * 2).reshape(3, 4, 2)
    (row,) = engine_routes([per_decoder_layer], routed, mask, replay)
    assert torch.equal(row[:2].long(), per_decoder_layer[:2, [1, 3]]) and bool((row[2] == NO_ROUTE).all())
    (row,) = engine_routes([per_decoder_layer[:, [1, 3]]], routed, mask, replay)
    assert torch.equal(row[:2].long(), per_decoder_layer[:2, [1, 3]])
    with pytest.raises(ValueError, match="the engine's routes have 3 layers, but the model has 2 MoE layers of 4"):
        engine_routes([per_decoder_layer[:, :3]], routed, mask, replay)
    with pytest.raises(ValueError, match="row 0 has 2 routed tokens but engine routes for 1"):
        engine_routes([per_decoder_layer[:1]], routed, mask, replay)
    with pytest.raises(ValueError, match="row 0's routed tokens are not the first 2 of its real tokens"):
        engine_routes([per_decoder_layer], [torch.tensor([True, False, True])], mask, replay)


# ---------------------------------------------------------------- config rules


def test_bad_routing_replay_value_names_the_key(compose, hf_config_dir):
    msg = problems_of(compose(f"trainer.policy.model.path={hf_config_dir('qwen3_moe')}", f"{MC}.moe_config.routing_replay=r1"))
    assert f"{MC}.moe_config.routing_replay: unknown value 'r1'" in msg and "use one of r2, r3 or null" in msg


def test_routing_replay_is_for_the_policy_and_top_k_routers(compose, hf_config_dir):
    path = hf_config_dir("qwen3_moe")
    ref = "trainer.ref.megatron_config.moe_config"
    msg = problems_of(compose(f"trainer.policy.model.path={path}", f"trainer.ref.model.path={path}", f"{ref}.routing_replay=r2"))
    assert f"{ref}.routing_replay: routing replay is for the policy's scoring and training passes" in msg
    msg = problems_of(
        compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config.routing_replay=r2", f"{MC}.moe_config.load_balancing_type=sinkhorn")
    )
    assert f"{MC}.moe_config.routing_replay: 'sinkhorn' routing does not choose experts by top-k" in msg
    msg = problems_of(
        compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config.routing_replay=r2",
                f"{MC}.transformer_config_kwargs.moe_router_fusion=true")
    )
    assert f"{MC}.transformer_config_kwargs.moe_router_fusion: Transformer Engine's fused router" in msg
    validate_config(compose(f"trainer.policy.model.path={path}", f"{MC}.moe_config.routing_replay=r2"))  # must not raise


def test_hf_engine_returns_the_experts_its_tokens_went_through(tmp_path):
    """R3's source: per row, every fed token's top-k experts per layer (prompt, then each sampled
    token but the last), the same as one full forward of the finished sequence picks."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from skyrl_megatron.engines.hf_engine import HFEngine

    make_tiny_hf_model("qwen3_moe", tmp_path, seed=11)
    engine = HFEngine(tmp_path, seed=0, return_routed_experts=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = {"max_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    out = asyncio.run(engine.generate({"prompt_token_ids": prompts, "sampling_params": params}))
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for prompt, response, routes in zip(prompts, out["response_ids"], out["rollout_expert_indices"]):
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            full = model(input_ids=tokens, output_router_logits=True).router_logits  # per layer [tokens, E]
        expected = torch.stack([logits.topk(2, dim=-1).indices for logits in full], dim=1)[:-1]  # [T - 1, L, k]
        got = torch.from_numpy(routes.astype("int64"))
        assert got.shape == expected.shape == (len(prompt) + len(response) - 1, 4, 2)
        assert torch.equal(got.sort(-1).values, expected.sort(-1).values)
    assert "rollout_expert_indices" not in asyncio.run(
        HFEngine(tmp_path, seed=0).generate({"prompt_token_ids": prompts, "sampling_params": params})
    )


# ---------------------------------------------------------------- training


class _ScoringFlip:
    """Test device around a router's `router_replay` (ours or none): scoring picks the 1st..(k-1)-th
    and the (k+1)-th expert of every token, training the top k (see the module docstring)."""

    def __init__(self, inner):
        self.inner = inner

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        def select(logits, k, num_groups=None, group_topk=None):
            if torch.is_grad_enabled():
                return default_compute_topk(logits, k, num_groups=num_groups, group_topk=group_topk)
            ranked = torch.topk(logits, k + 1, dim=1).indices
            chosen = torch.cat([ranked[:, : k - 1], ranked[:, k:]], dim=1)
            return logits.gather(1, chosen), chosen

        if self.inner is None:
            return select(scores, topk, num_groups, group_topk)
        return self.inner.get_replay_topk(scores, topk, num_groups, group_topk, select)


def _flip_scoring(chunks) -> None:
    from skyrl_megatron.model.moe.settings import routers

    for _, router in routers(chunks):
        router.router_replay = _ScoringFlip(router.router_replay)


def _runs(rank, world_size, hf_dir, plan: dict, rollout: dict | None = None) -> dict:
    out = {}
    for name, (layout, batching, extra) in plan.items():
        if extra.get("engine_routes"):  # R3: the HF engine's rollout and routes
            extra = {**extra, "batch": rollout["batch"], "engine_routes": rollout["routes"],
                     "prompt_length": rollout["prompt_length"], "response_length": rollout["response_length"]}
        run = policy_steps(rank, world_size, hf_dir, layout, batching, steps=1, ratio_check=True, prepare=_flip_scoring, **extra)
        first = run["history"][0]
        out[name] = {
            "ppo_kl": first["ppo_kl"],
            "abs_log_ratio_sum": first["abs_log_ratio_sum"],
            "routes_replayed_bitwise": (
                torch.equal(run["recorded_routes"], run["replayed_routes"]) if "recorded_routes" in run else None
            ),
            "routes_recorded": int((run["recorded_routes"] != NO_ROUTE).sum()) if "recorded_routes" in run else 0,
        }
        engine = run.get("engine_routes")
        if engine is not None:  # R3: scoring replayed the engine's routes wherever it gave one
            given = engine != NO_ROUTE
            out[name]["engine_routes_given"] = int(given.sum())
            out[name]["engine_routes_replayed_bitwise"] = torch.equal(run["recorded_routes"][given], engine[given])
    return out


WORLD1 = {
    "flip": ({}, PADDED, {}),
    "padded": ({}, PADDED, {"routing_replay": True}),
    "packed": ({}, PACKED, {"routing_replay": True}),
    # scored in rows of 2, trained in packed micro-batches: other shapes, the same routes
    "other_plan": ({}, PACKED, {"routing_replay": True, "score_batching": {"micro_batch_size": 2}}),
    "r3": ({}, PACKED, {"routing_replay": True, "engine_routes": True}),
}
WORLD4 = {
    "tp2_ep2_flip": ({"tensor": 2, "expert": 2, "sequence_parallel": True}, PACKED, {}),
    "ep2": ({"expert": 2}, PACKED, {"routing_replay": True}),
    "tp2_ep2": ({"tensor": 2, "expert": 2, "sequence_parallel": True}, PACKED, {"routing_replay": True}),
    "tp2_ep2_allgather": (
        {"tensor": 2, "expert": 2, "sequence_parallel": True}, PADDED,
        {"routing_replay": True, "spec_overrides": {"moe": MoeSettings(token_dispatcher="allgather")}},
    ),
    "pp2_ep2_recompute": (
        {"pipeline": 2, "expert": 2}, PADDED, {"routing_replay": True, "spec_overrides": {"transformer_overrides": RECOMPUTE}},
    ),
    "cp2": ({"context": 2}, PACKED, {"routing_replay": True}),
    "tp2_etp1_ep2": ({"tensor": 2, "expert_tensor": 1, "expert": 2, "sequence_parallel": True}, PACKED, {"routing_replay": True}),
    "pp2_vpp2_recompute": (
        {"pipeline": 2, "virtual_pipeline": 2}, PADDED,
        {"routing_replay": True, "spec_overrides": {"transformer_overrides": RECOMPUTE}},
    ),
    # each stage takes its own layers' columns of the engine's routes
    "pp2_ep2_r3": ({"pipeline": 2, "expert": 2}, PADDED, {"routing_replay": True, "engine_routes": True}),
    # the engine's routes split like their tokens: over TP ranks (SP), and over CP ranks
    "tp2_ep2_r3": ({"tensor": 2, "expert": 2, "sequence_parallel": True}, PACKED, {"routing_replay": True, "engine_routes": True}),
    "cp2_r3": ({"context": 2}, PACKED, {"routing_replay": True, "engine_routes": True}),
    # interleaved chunks each take their own layers' columns; recompute replays them again
    "pp2_vpp2_recompute_r3": (
        {"pipeline": 2, "virtual_pipeline": 2}, PADDED,
        {"routing_replay": True, "engine_routes": True, "spec_overrides": {"transformer_overrides": RECOMPUTE}},
    ),
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny_hf_model("qwen3_moe", out, seed=11)
    return str(out)


ROLLOUT_ROWS, ROLLOUT_PROMPT, ROLLOUT_RESPONSE = 8, 6, 6


@pytest.fixture(scope="module")
def rollout(moe_model) -> dict:
    """Rows sampled by the HF engine with its routes, laid out as the host's training batch."""
    import asyncio

    from skyrl_megatron.engines.hf_engine import HFEngine

    engine = HFEngine(moe_model, seed=3, return_routed_experts=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, ROLLOUT_PROMPT + 1, (ROLLOUT_ROWS,), generator=g)]
    params = {"max_tokens": ROLLOUT_RESPONSE, "temperature": 1.0, "ignore_eos": True, "min_tokens": 1}
    out = asyncio.run(engine.generate({"prompt_token_ids": prompts, "sampling_params": params}))
    width = ROLLOUT_PROMPT + ROLLOUT_RESPONSE
    sequences = torch.zeros(ROLLOUT_ROWS, width, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    loss_mask = torch.zeros(ROLLOUT_ROWS, ROLLOUT_RESPONSE)
    for i, (prompt, response) in enumerate(zip(prompts, out["response_ids"])):
        start = ROLLOUT_PROMPT - len(prompt)
        sequences[i, start : ROLLOUT_PROMPT + len(response)] = torch.tensor(prompt + response)
        attention_mask[i, start : ROLLOUT_PROMPT + len(response)] = 1
        loss_mask[i, : len(response)] = 1
        assert out["rollout_expert_indices"][i].shape == (len(prompt) + len(response) - 1, 4, 2)
    batch = {
        "sequences": sequences, "attention_mask": attention_mask, "loss_mask": loss_mask,
        "advantages": torch.randn(ROLLOUT_ROWS, ROLLOUT_RESPONSE, generator=g) * loss_mask,
    }
    return {"batch": batch, "routes": out["rollout_expert_indices"],
            "prompt_length": ROLLOUT_PROMPT, "response_length": ROLLOUT_RESPONSE}


@pytest.fixture(scope="module")
def world1(moe_model, rollout) -> dict:
    (runs,) = run_on_ranks(_runs, 1, moe_model, WORLD1, rollout, timeout=600)
    return runs


@pytest.fixture(scope="module")
def world4(moe_model, rollout) -> list[dict]:
    return run_on_ranks(_runs, 4, moe_model, WORLD4, rollout, timeout=600)


def _assert_ratio_exactly_one(run: dict, what: str) -> None:
    assert run["abs_log_ratio_sum"] == 0.0, f"{what}: log-probs differ from the scored ones by {run['abs_log_ratio_sum']}"
    assert run["ppo_kl"] == 0.0, f"{what}: ppo_kl {run['ppo_kl']}"
    assert run["routes_replayed_bitwise"], f"{what}: replayed routes differ from the recorded ones"


@pytest.mark.slow
def test_without_replay_the_flip_moves_the_first_step_ratio(world1, world4):
    for what, run in (("world 1", world1["flip"]), ("tp2 x ep2", world4[0]["tp2_ep2_flip"])):
        assert run["abs_log_ratio_sum"] > 1e-2 and run["ppo_kl"] != 0.0, f"{what}: the flip changed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["padded", "packed"])
def test_world1_replay_makes_the_first_step_ratio_exactly_one(world1, name):
    _assert_ratio_exactly_one(world1[name], f"world 1 {name}")
    assert world1[name]["routes_recorded"] > 0


@pytest.mark.slow
def test_routes_replay_bitwise_under_another_micro_batch_plan(world1):
    run = world1["other_plan"]
    assert run["routes_replayed_bitwise"]
    # the log-probs of differently shaped micro-batches differ in the last bits (CPU GEMMs are not
    # batch-invariant), far below what a routing flip moves
    assert run["abs_log_ratio_sum"] < 1e-3 * world1["flip"]["abs_log_ratio_sum"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["ep2", "tp2_ep2", "tp2_ep2_allgather", "tp2_etp1_ep2", "pp2_ep2_recompute", "pp2_vpp2_recompute", "cp2"]
)
def test_layout_replay_makes_the_first_step_ratio_exactly_one(world4, layout):
    for rank, runs in enumerate(world4):
        _assert_ratio_exactly_one(runs[layout], f"{layout} rank {rank}")


@pytest.mark.slow
def test_r3_replays_the_engines_routes_in_scoring_and_training(world1, world4):
    runs4 = [(f"{layout} rank {r}", runs[layout]) for r, runs in enumerate(world4) for layout in ("pp2_ep2_r3", "tp2_ep2_r3", "cp2_r3", "pp2_vpp2_recompute_r3")]
    for what, run in [("world 1", world1["r3"])] + runs4:
        assert run["engine_routes_given"] > 0 and run["engine_routes_replayed_bitwise"], f"{what}: engine routes not replayed"
        _assert_ratio_exactly_one(run, f"{what} r3")
