"""R3 routing replay on skyrl 0.4: the engine's routes, replayed in scoring and training (CPU, fp32, Ray).

Our HF engine (`EngineClient`, as `generator.engine=cpu` gives the host) samples rows of a tiny
Qwen3-MoE and returns every forwarded token's experts. The host's own code takes them from there:
its `RoutedExpertTrace` checks the engine's route rows against the tokens, `validate_generator_output`
and `convert_to_training_input` pack them into `rollout_expert_indices` + `router_padding_mask`, its
`fwd_logprobs_values_reward` scores through our policy's `forward` (replaying them) and its
`train_critic_and_policy` trains through `forward_backward` (replaying what scoring recorded).

The near-tie is in the weights: two experts of every router have rows one rounding step apart, so
which of the two a token takes is decided by the last bits of its hidden state. The engine
(transformers, KV-cached decoding) and Megatron compute those bits differently: without replay they
disagree on some tokens, which the reference model (same weights, no replay) shows. With r3, scoring
replays the engine's routes bitwise, and the first training step's ratio is exactly 1 (ppo_kl 0).
The step has two mini-batches, scored one by one before either trains (the host's default), and
a learning rate of 0, so each of them is a "first" step. The same checks on every MoE layout, at the
runner level, are in tests/test_route_replay.py.
"""

from __future__ import annotations

import asyncio
import glob

import numpy as np
import pytest
import torch

from skyrl_megatron.compute.route_replay import NO_ROUTE
from skyrl_megatron.testing import make_tiny_hf_model
from skyrl_megatron.testing.host_trainer import build_worker_groups, host_trainer, start_ray_for_cpu_workers

pytestmark = pytest.mark.slow

PROMPTS, N_SAMPLES, MAX_PROMPT, RESPONSE = 4, 2, 6, 6
ROWS = PROMPTS * N_SAMPLES
MC = "trainer.policy.megatron_config"
NEAR_TIED = ((2, 3), (4, 5))  # expert pairs whose router rows differ by about one rounding step


def _near_tied_moe(path: str) -> None:
    """A tiny Qwen3-MoE whose routers cannot tell two experts of each pair apart beyond rounding."""
    from safetensors.torch import load_file, save_file

    make_tiny_hf_model("qwen3_moe", path, seed=11)
    (weights_file,) = glob.glob(f"{path}/*.safetensors")
    weights = load_file(weights_file)
    g = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith("mlp.gate.weight"):
            for a, b in NEAR_TIED:
                tensor[b] = tensor[a] + 1e-9 * torch.randn(tensor.shape[1], generator=g)
    save_file(weights, weights_file, metadata={"format": "pt"})


def _config(hf_dir: str, workdir):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config

    cache = workdir / "conversion_cache"
    cfg = compose_config([
        f"trainer.policy.model.path={hf_dir}",
        f"trainer.ckpt_path={workdir}/ckpt",
        f"trainer.export_path={workdir}/export",
        "trainer.bf16=false",
        "trainer.placement.colocate_all=false",
        "trainer.placement.colocate_policy_ref=false",
        "trainer.placement.policy_num_gpus_per_node=1",
        "trainer.placement.ref_num_gpus_per_node=1",
        "generator.engine=cpu",
        "generator.inference_engine.weight_sync_backend=gloo",
        f"generator.n_samples_per_prompt={N_SAMPLES}",
        f"trainer.train_batch_size={PROMPTS}",
        # two mini-batches, scored one by one (0.4's recompute_old_logprobs_per_minibatch) before either
        # trains; lr 0 keeps the weights, so every mini-batch's ratio must be exactly 1, not only the first's
        f"trainer.policy_mini_batch_size={PROMPTS // 2}",
        "trainer.policy.optimizer_config.lr=0.0",
        "trainer.policy.optimizer_config.num_warmup_steps=0",
        "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.algorithm.use_kl_loss=true",  # the reference model: the same weights, no replay
        f"trainer.algorithm.max_seq_len={MAX_PROMPT + RESPONSE}",
        f"{MC}.runtime=cpu",
        f"{MC}.checkpoint_cache_dir={cache}",
        f"{MC}.moe_config.routing_replay=r3",
        "trainer.ref.megatron_config.runtime=cpu",
        f"trainer.ref.megatron_config.checkpoint_cache_dir={cache}",
        "trainer.remove_microbatch_padding=false",
    ])
    validate_config(cfg)
    return cfg


def _rollout(client, tokenizer) -> dict:
    """What 0.4's agent loop gets from its engine for each prompt, as its trace checks and keeps it."""
    from skyrl.backends.skyrl_train.utils.routed_experts import RoutedExpertTrace

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, MAX_PROMPT + 1, (PROMPTS,), generator=g)]
    prompts = [p for p in prompts for _ in range(N_SAMPLES)]
    params = {"max_tokens": RESPONSE, "temperature": 1.0, "ignore_eos": True, "min_tokens": 1}
    out = asyncio.run(client.generate({
        "prompt_token_ids": prompts, "sampling_params": params, "session_ids": None,
        "routed_experts_prompt_starts": [0] * ROWS,  # first turn: routes from the first token
    }))
    routes = []
    for prompt, response, given in zip(prompts, out["response_ids"], out["rollout_expert_indices"]):
        trace = RoutedExpertTrace()
        trace.record_generation(prompt_token_count=len(prompt), generated_token_count=len(response), routed_experts=given)
        routes.append(trace.finalize(token_count=len(prompt) + len(response), loss_mask=[0] * len(prompt) + [1] * len(response)))
    return {
        "prompt_token_ids": prompts,
        "response_ids": out["response_ids"],
        "rewards": torch.randn(ROWS, generator=g).tolist(),
        "loss_masks": [[1] * len(r) for r in out["response_ids"]],
        "stop_reasons": out["stop_reasons"],
        "rollout_metrics": None,
        "rollout_logprobs": None,
        "rollout_expert_indices": routes,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    from skyrl_megatron.engines.client import create_engine_client

    workdir = tmp_path_factory.mktemp("host04_r3")
    hf_dir = str(workdir / "qwen3_moe")
    _near_tied_moe(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    cfg = _config(hf_dir, workdir)
    start_ray_for_cpu_workers(num_gpus=2, num_cpus=4)
    try:
        client = create_engine_client(1, hf_dir, seed=3, return_routed_experts=True)
        trainer = host_trainer(cfg, tokenizer, total_training_steps=10)
        build_worker_groups(trainer)
        yield trainer, client, _rollout(client, tokenizer)
    finally:
        ray.shutdown()


def _recorded_routes(trainer, data) -> torch.Tensor:
    import ray

    (routes,) = ray.get(trainer.policy_model.async_run_ray_method(
        "pass_through", "recorded_routes", data["sequences"], data["attention_mask"]))
    return routes


def test_r3_replays_the_engines_routes_and_the_first_step_ratio_is_exactly_one(run):
    from skyrl.train.utils.trainer_utils import validate_generator_output

    trainer, _, rollout = run
    generator_output = dict(rollout)
    validate_generator_output(ROWS, generator_output, routes_expected=True)
    uids = [str(i // N_SAMPLES) for i in range(ROWS)]
    generator_output, uids = trainer.postprocess_generator_output(generator_output, uids)
    data = trainer.convert_to_training_input(generator_output, uids)
    sequences, attention_mask = data["sequences"].clone(), data["attention_mask"].clone()
    engine_given = ~data["router_padding_mask"] & attention_mask.bool()  # the tokens the engine routed
    from_engine = torch.full((*attention_mask.shape, *data["rollout_expert_indices"].row_shape), NO_ROUTE, dtype=torch.long)
    for i in range(ROWS):
        from_engine[i, attention_mask[i].bool()] = data["rollout_expert_indices"].segment(i).long()

    data = trainer.fwd_logprobs_values_reward(data)
    recorded = _recorded_routes(trainer, {"sequences": sequences, "attention_mask": attention_mask})
    # every token the engine routed, scoring routed bitwise the same; the rest (each row's last token) it chose
    assert int(engine_given.sum()) == sum(len(r) + len(p) - 1 for p, r in zip(rollout["prompt_token_ids"], rollout["response_ids"]))
    assert torch.equal(recorded.long()[engine_given], from_engine[engine_given])
    assert bool((recorded[attention_mask.bool()] != NO_ROUTE).all())

    # the flip is real: the reference model (same weights, its own routing) scores differently
    mask = data["loss_mask"].bool()
    moved = (data["action_log_probs"] - data["base_action_log_probs"]).abs()[mask].max().item()
    assert moved > 1e-4, f"without replay the routing did not flip: policy and ref differ by {moved:.2e}"

    data = trainer.compute_advantages_and_returns(data)
    data.pop("rewards")
    data.metadata.pop("uids")
    status = trainer.train_critic_and_policy(data)
    assert status["ppo_kl"] == 0.0 and status["ppo_clip_ratio"] == 0.0


def test_engine_client_returns_routes_from_each_rows_start(run):
    """0.4's multi-turn generator holds earlier turns' routes and asks for the rest (prompt starts)."""
    _, client, _ = run
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = {"max_tokens": 3, "temperature": 1.0, "ignore_eos": True, "seed": 1}
    full = asyncio.run(client.generate({"prompt_token_ids": prompts, "sampling_params": params}))
    tail = asyncio.run(client.generate({
        "prompt_token_ids": prompts, "sampling_params": params, "routed_experts_prompt_starts": [2, 0],
    }))
    assert tail["response_ids"] == full["response_ids"]
    for start, whole, part in zip([2, 0], full["rollout_expert_indices"], tail["rollout_expert_indices"]):
        assert isinstance(part, np.ndarray) and part.dtype == np.uint8 and part.shape[1:] == (4, 2)
        assert np.array_equal(part, whole[start:])
