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
    """The host's own logprob path (HFModelWrapper, eager attention, fp32) on the same batch."""
    from skyrl_megatron.activation import activate

    activate()
    import skyrl_train.utils.torch_utils as torch_utils
    from skyrl_train.model_wrapper import HFModelWrapper

    # flash-attn's Triton cross entropy imports without a GPU but cannot run on CPU
    torch_utils.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5)
    model = HFModelWrapper(hf_dir, bf16=False).eval()
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


def _host_loss_terms(hf_dir: str, overrides: list[str], noise: float) -> dict[str, float]:
    """The host's loss math on the host's own HF logprobs/entropy of the same batch."""
    from skyrl_megatron.activation import activate
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.testing.rl_batches import perturb_logprobs

    activate()
    import skyrl_train.utils.torch_utils as torch_utils
    from skyrl_train.model_wrapper import HFModelWrapper
    from skyrl_train.utils.ppo_utils import PolicyLossRegistry, compute_approx_kl, masked_mean

    torch_utils.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5)
    model = HFModelWrapper(hf_dir, bf16=False).eval()
    with torch.no_grad():
        logprobs, output = model(
            batch["sequences"], RESPONSE, batch["attention_mask"], return_output=True, compute_entropy=True
        )
    entropy = output["entropy"][:, -RESPONSE - 1 : -1]
    mask = batch["loss_mask"]
    old = perturb_logprobs(logprobs.float(), mask, noise, seed=5)
    base = old - 0.1 * mask
    cfg = compose_config([*overrides, f"++trainer.algorithm.max_seq_len={PROMPT + RESPONSE}"])
    algorithm = cfg.trainer.algorithm
    policy_loss, clip_ratio = PolicyLossRegistry.get(algorithm.policy_loss_type)(
        logprobs, old, batch["advantages"], config=algorithm, loss_mask=mask, rollout_logprobs=batch["rollout_logprobs"]
    )
    kl = masked_mean(compute_approx_kl(logprobs, base, loss_mask=mask, kl_estimator_type="k3"), mask, dim=-1).mean()
    return {
        "policy_loss": float(policy_loss),
        "ppo_clip_ratio": float(clip_ratio),
        "policy_entropy": float(masked_mean(entropy, mask)),
        "policy_kl": float(kl),
    }


# every policy-loss type with a different loss reduction; TIS (truncated importance sampling) once
LOSS_CASES = {
    "regular-token_mean-tis": ("regular", "token_mean", True),
    "dual_clip-seq_mean_token_sum_norm": ("dual_clip", "seq_mean_token_sum_norm", False),
    "gspo-sequence_mean": ("gspo", "sequence_mean", False),
    "cispo-token_mean": ("cispo", "token_mean", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_single_rank_step_reproduces_host_loss_math(models, case):
    loss_type, reduction, tis = LOSS_CASES[case]
    hf_dir = models("qwen3")["dir"]
    noise = 0.3  # old logprobs off-policy, so ratios leave 1 and clipping engages
    algorithm = [
        f"trainer.algorithm.policy_loss_type={loss_type}",
        f"trainer.algorithm.loss_reduction={reduction}",
        f"trainer.algorithm.use_tis={str(tis).lower()}",
        "trainer.algorithm.tis_imp_ratio_cap=2.0",
    ]
    want = _host_loss_terms(hf_dir, [*HOST_OVERRIDES, *algorithm], noise)
    overrides = (*HOST_OVERRIDES, *algorithm)
    (result,) = run_on_ranks(
        policy_steps,
        1,
        hf_dir,
        {},
        {"micro_batch_size": ROWS},
        host_overrides=overrides,
        steps=1,
        old_logprob_noise=noise,
        timeout=600,
    )
    got = result["history"][0]
    if loss_type != "gspo":
        assert want["ppo_clip_ratio"] > 0, "the test batch should clip some tokens"
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{case} {name}: {got[name]} vs host {value}"
