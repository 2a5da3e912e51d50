"""One policy step on one rank reproduces skyrl-train 0.3.1's own loss math (CPU, fp32).

0.3.1's policy losses reduce over what each call gets (`loss_reduction`), so its `PolicyLossRegistry`
on its own HF logprobs gives the numbers our worker must report. skyrl 0.4 pre-scales advantages
and sums instead; its step is checked through its trainer (tests/host04/test_skyrl04_workers.py).
The layout tests sharing these constants run on both hosts (tests/test_policy_worker.py).
"""

from __future__ import annotations

import pytest
import torch
from test_policy_worker import HOST_OVERRIDES, PROMPT, RESPONSE, ROWS

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.policy_steps import policy_steps


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen3")
    make_tiny_hf_model("qwen3", out, seed=11)
    return str(out)


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
def test_single_rank_step_reproduces_host_loss_math(hf_dir, case):
    loss_type, reduction, tis = LOSS_CASES[case]
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
