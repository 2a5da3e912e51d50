"""R3 (`moe_config.routing_replay=r3`) on skyrl 0.4: what it turns on, where it is accepted, what it refuses.

skyrl 0.4 carries the engines' routes to the trainer when its generator asks for them
(`generator.inference_engine.enable_return_routed_experts`), and its checks want the host's own
`moe_enable_routing_replay` with that flag: r3 sets both, and the host's spelling of the pair means r3.
"""

from __future__ import annotations

import pytest

from skyrl_megatron.config import ConfigError
from skyrl_megatron.hosts import current
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"
ROUTES = "generator.inference_engine.enable_return_routed_experts"
HF_ENGINE = ["generator.engine=cpu", "generator.inference_engine.weight_sync_backend=gloo",
             "trainer.placement.colocate_all=false"]


@pytest.fixture
def moe(tmp_path, hf_config_dir, compose):
    path = hf_config_dir("qwen3_moe")

    def make(*overrides: str):
        return compose("trainer.strategy=megatron", f"trainer.policy.model.path={path}", f"{MC}.runtime=cpu", *overrides)

    return make


def _routing_replay(cfg) -> str | None:
    return current().our_view(cfg).trainer.policy.megatron_config.moe_config.get("routing_replay")


def problems_of(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


def test_r3_turns_on_the_hosts_engine_routes_and_passes_with_our_hf_engine(moe):
    cfg = moe(f"{MC}.moe_config.routing_replay=r3", *HF_ENGINE)
    assert cfg.generator.inference_engine.enable_return_routed_experts is True
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is True
    validate_config(cfg)  # ours and the host's checks (its vLLM executor rule does not concern our engine)
    assert cfg.generator.inference_engine.distributed_executor_backend == "ray"  # left as the user set it


def test_the_hosts_spelling_of_r3_is_r3_and_its_router_replay_alone_is_r2(moe):
    assert _routing_replay(moe(f"{MC}.moe_enable_routing_replay=true", f"{ROUTES}=true", *HF_ENGINE)) == "r3"
    assert _routing_replay(moe(f"{MC}.moe_enable_routing_replay=true")) == "r2"
    assert _routing_replay(moe(f"{MC}.moe_enable_routing_replay=true", f"{MC}.moe_config.routing_replay=r2")) == "r2"


def test_r3_with_vllm_takes_the_hosts_rules_for_its_engines(moe):
    msg = problems_of(moe(f"{MC}.moe_config.routing_replay=r3"))
    assert "(host check)" in msg and "use the vLLM mp backend" in msg
    validate_config(moe(f"{MC}.moe_config.routing_replay=r3", "generator.inference_engine.distributed_executor_backend=mp"))


def test_r3_without_the_engines_routes_names_the_hosts_key(moe):
    cfg = moe(f"{MC}.moe_config.routing_replay=r3", *HF_ENGINE)
    cfg.generator.inference_engine.enable_return_routed_experts = False  # e.g. a config built past our dataclass
    msg = problems_of(cfg)
    assert f"{MC}.moe_config.routing_replay: r3 replays the routes the inference engines return" in msg
    assert f"set {ROUTES}=true" in msg


def test_r3_refuses_generator_modes_whose_tokens_have_no_engine_route(moe):
    msg = problems_of(moe(f"{MC}.moe_config.routing_replay=r3", "generator.use_conversation_multi_turn=false", *HF_ENGINE))
    assert "generator.use_conversation_multi_turn: without it the host appends an EOS token" in msg
    msg = problems_of(moe(f"{MC}.moe_config.routing_replay=r3", "generator.step_wise_trajectories=true", *HF_ENGINE))
    assert "generator.step_wise_trajectories: a step-wise row's prompt is the whole history" in msg


def test_r3_needs_an_moe_model_and_is_the_policys(compose, hf_config_dir):
    dense = hf_config_dir("qwen3")
    msg = problems_of(compose("trainer.strategy=megatron", f"trainer.policy.model.path={dense}",
                              f"{MC}.moe_config.routing_replay=r3", *HF_ENGINE))
    assert f"{MC}.moe_config.routing_replay: r3 replays MoE routes, but qwen3 at the model path has no experts" in msg
    moe = hf_config_dir("qwen3_moe")
    ref = "trainer.ref.megatron_config.moe_config.routing_replay"
    msg = problems_of(compose("trainer.strategy=megatron", f"trainer.policy.model.path={moe}", f"trainer.ref.model.path={moe}",
                              f"{ref}=r3", *HF_ENGINE))
    assert f"{ref}: routing replay is for the policy's scoring and training passes" in msg


def test_the_hosts_experiment_starts_our_engine_with_routes_under_r3(moe):
    """`generator.engine=cpu` on 0.4: the host's `get_inference_client` hook starts our engines, asking
    them for routes exactly when the host's generator will (its enable_return_routed_experts)."""
    import types

    from skyrl_megatron.hosts.skyrl_0_4 import _route_local_engines

    started = []

    class Experiment:
        def get_inference_client(self):
            raise AssertionError("the host's own engines were started")

    _route_local_engines(types.SimpleNamespace(BasePPOExp=Experiment), lambda *args, **kwargs: started.append(kwargs))
    for overrides, routes in (([f"{MC}.moe_config.routing_replay=r3"], True), ([], False)):
        experiment = Experiment()
        experiment.cfg = moe(*overrides, *HF_ENGINE)
        experiment.get_inference_client()
        assert started[-1]["return_routed_experts"] is routes
