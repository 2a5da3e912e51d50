"""Policy/ref compute under every parallel layout (CPU, gloo, fp32).

Per layout, one spawn of ranks scores a synthetic RL batch (logprobs compared with the host's own
HF model wrapper) and trains three steps with the host's objective, padded and packed; losses and
grad norms must equal the world-1 run.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.policy_steps import policy_steps

ROWS, PROMPT, RESPONSE = 8, 6, 6
LOGPROB_ATOL = 1e-4
TRAIN_RTOL = 1e-5
HOST_OVERRIDES = (
    "trainer.algorithm.use_kl_loss=true",
    "trainer.algorithm.kl_loss_coef=0.1",
    "trainer.algorithm.use_entropy_loss=true",
    "trainer.algorithm.entropy_loss_coef=0.01",
)
PADDED = {"micro_batch_size": 3}
PACKED = {"max_tokens": 30}

DENSE_LAYOUTS = {
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline": 2}),
    "pp2_vpp2": (2, {"pipeline": 2, "virtual_pipeline": 2}),
    "cp2": (2, {"context": 2}),
    "dp2": (2, {}),
    "tp2_pp2": (4, {"tensor": 2, "pipeline": 2, "sequence_parallel": True}),
}
MOE_LAYOUTS = {"ep2": (2, {"expert": 2})}


def _host_logprobs(hf_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The installed host's own logprob path (its HFModelWrapper, fp32) on the same batch."""
    from skyrl_megatron.testing.host_models import host_hf_model

    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5)
    model = host_hf_model(hf_dir)
    with torch.no_grad():
        logprobs = model(batch["sequences"], RESPONSE, batch["attention_mask"]).float()
    return logprobs, batch["loss_mask"].bool()


def _padded_and_packed_steps(rank, world_size, hf_dir: str, layout: dict) -> dict:
    """Both micro-batchings in one spawn of ranks (start-up dominates a tiny model's run)."""
    return {
        name: policy_steps(rank, world_size, hf_dir, layout, batching, host_overrides=HOST_OVERRIDES)
        for name, batching in (("padded", PADDED), ("packed", PACKED))
    }


def _run(hf_dir: str, world: int, layout: dict) -> dict:
    runs = {}
    spawned = run_on_ranks(_padded_and_packed_steps, world, hf_dir, layout, timeout=900)
    for name in ("padded", "packed"):
        results = [per_rank[name] for per_rank in spawned]
        logprobs = torch.zeros(ROWS, RESPONSE)
        for r in results:
            if r["initial_logprobs"] is not None:
                start, stop = r["rows"]
                logprobs[start:stop] = r["initial_logprobs"]
        histories = [r["history"] for r in results]
        assert all(h == histories[0] for h in histories), "ranks disagree on the training metrics"
        runs[name] = {"logprobs": logprobs, "history": histories[0]}
    return runs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(family)
            make_tiny_hf_model(family, out, seed=11)
            reference = _host_logprobs(str(out))
            cache[family] = {"dir": str(out), "host": reference, "world1": _run(str(out), 1, {})}
        return cache[family]

    return get


def _assert_logprobs_match_host(runs: dict, host_reference) -> None:
    host_logprobs, mask = host_reference
    for name, run in runs.items():
        diff = (run["logprobs"] - host_logprobs).abs()[mask].max().item()
        assert diff <= LOGPROB_ATOL, f"{name}: logprobs differ from the host's by {diff:.2e}"


def _assert_same_training(runs: dict, reference: dict) -> None:
    for name, run in runs.items():
        for step, (got, want) in enumerate(zip(run["history"], reference[name]["history"])):
            for metric in ("final_loss", "policy_loss", "policy_kl", "policy_entropy", "grad_norm"):
                assert got[metric] == pytest.approx(want[metric], rel=TRAIN_RTOL, abs=1e-7), (
                    f"{name} step {step} {metric}: {got[metric]} vs world-1 {want[metric]}"
                )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_world1_matches_host_logprobs_and_first_step_is_on_policy(models, family):
    model = models(family)
    _assert_logprobs_match_host(model["world1"], model["host"])
    for run in model["world1"].values():
        first = run["history"][0]
        # old logprobs come from the same forward: ratio exactly 1, nothing clipped
        assert first["ppo_kl"] == 0.0
        assert first["ppo_clip_ratio"] == 0.0
    # padded and packed micro-batches compute the same thing
    padded, packed = model["world1"]["padded"], model["world1"]["packed"]
    assert (padded["logprobs"] - packed["logprobs"]).abs().max().item() <= 1e-5
    for a, b in zip(padded["history"], packed["history"]):
        assert a["final_loss"] == pytest.approx(b["final_loss"], rel=TRAIN_RTOL)


CASES = [("qwen3", name, *spec) for name, spec in DENSE_LAYOUTS.items()] + [
    ("qwen3_moe", name, *spec) for name, spec in MOE_LAYOUTS.items()
]


@pytest.mark.slow
@pytest.mark.parametrize("family,name,world,layout", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_layout_matches_world1(models, family, name, world, layout):
    model = models(family)
    runs = _run(model["dir"], world, layout)
    _assert_logprobs_match_host(runs, model["host"])
    _assert_same_training(runs, model["world1"])
