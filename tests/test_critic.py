"""The critic's value model and value-loss training under every parallel layout (CPU, gloo, fp32).

Values of a synthetic RL batch match the host's critic forward (skyrl-train's CriticModel: HF trunk
+ linear value head) on the HF model with the same head weights;
values and two training steps with the host's value loss (clipping engaged) equal the world-1 run
under TP2+SP, PP2, PP2 x VPP2, CP2 and DP2, and for a Qwen3-MoE critic under EP2 and TP2 x EP2 (ETP1);
a checkpoint saved under one layout resumes under another.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks
from skyrl_megatron.testing.critic_steps import critic_steps

ROWS, PROMPT, RESPONSE = 8, 6, 6
VALUE_ATOL = 1e-5
# the first step's metrics agree to float noise; after one Adam step (an update of about lr per
# weight whatever the gradient's size) the second step's tiny gradient norm (~0.08) carries the
# layouts' different reduction orders at ~2e-5 relative (TP2+SP measured 1.5e-5)
TRAIN_RTOL = (1e-5, 1e-4)
# the values after those steps: the updates' reduction-order noise reaches them too (TP2 x EP2 measured
# 1.06e-5 on an AMD EPYC host, within 1e-5 on others); a wrong layout moves them by orders of magnitude more
FINAL_VALUE_ATOL = 3e-5
PADDED = {"micro_batch_size": 3}
PACKED = {"max_tokens": 30}

LAYOUTS = {
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}, PADDED),
    "pp2": (2, {"pipeline": 2}, PADDED),
    "pp2_vpp2": (2, {"pipeline": 2, "virtual_pipeline": 2}, PADDED),
    "cp2": (2, {"context": 2}, PACKED),
    "dp2": (2, {}, PADDED),
}


def _hf_critic_values(hf_dir: str, head_weight: torch.Tensor) -> torch.Tensor:
    """The host's critic forward (skyrl-train's CriticModel) written out on an HF trunk (eager
    attention, fp32) with our head's weights: the value of the state before each response token.

    The host's own CriticModel cannot be built under transformers 5 (its __init__ skips
    `post_init`, so `from_pretrained` fails on `all_tied_weights_keys`); its forward is three lines.
    """
    from transformers import AutoModel

    trunk = AutoModel.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5)
    mask = batch["attention_mask"]
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        hidden = trunk(batch["sequences"], attention_mask=mask, position_ids=position_ids).last_hidden_state
        values = (hidden @ head_weight.t()).squeeze(-1)[:, :-1]
    return values[:, -RESPONSE:]


def _gather(results: list[dict], key: str) -> torch.Tensor:
    values = torch.zeros(ROWS, RESPONSE)
    for r in results:
        if r[key] is not None:
            start, stop = r["rows"]
            values[start:stop] = r[key]
    return values


def _run(hf_dir: str, world: int, layout: dict, batching: dict, **kwargs) -> dict:
    results = run_on_ranks(critic_steps, world, hf_dir, layout, batching, timeout=900, **kwargs)
    histories = [r["history"] for r in results]
    assert all(h == histories[0] for h in histories), "ranks disagree on the training metrics"
    return {"initial": _gather(results, "initial_values"), "final": _gather(results, "final_values"),
            "history": histories[0]}


def _critic_model(family: str, directory, batchings: dict[str, dict]) -> dict:
    from skyrl_megatron.model.adapters.value_head import ValueHeadInit

    hf_dir = str(make_tiny_hf_model(family, directory, seed=11))
    head = ValueHeadInit.for_checkpoint(hf_dir, policy_path=hf_dir, seed=5).make_weight(torch.float32)
    return {
        "dir": hf_dir,
        "host": _hf_critic_values(hf_dir, head),
        "world1": {name: _run(hf_dir, 1, {}, batching) for name, batching in batchings.items()},
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _critic_model("qwen3", tmp_path_factory.mktemp("qwen3"), {"padded": PADDED, "packed": PACKED})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return _critic_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), {"padded": PADDED})


def _mask() -> torch.Tensor:
    return make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5)["loss_mask"].bool()


def _assert_values_match_host(values: torch.Tensor, host_values: torch.Tensor) -> None:
    mask = _mask()
    diff = (values - host_values).abs()[mask].max().item()
    assert diff <= VALUE_ATOL, f"values differ from the HF critic by {diff:.2e}"
    # past the end of a response the state is terminal: value 0 (GAE bootstraps from it)
    assert values[~mask].abs().max().item() == 0.0


def _assert_same_training(run: dict, reference: dict) -> None:
    assert (run["final"] - reference["final"]).abs().max().item() <= FINAL_VALUE_ATOL
    for step, (got, want) in enumerate(zip(run["history"], reference["history"], strict=True)):
        for metric in ("critic_loss", "values_mean", "values_clipfrac", "grad_norm"):
            assert got[metric] == pytest.approx(want[metric], rel=TRAIN_RTOL[min(step, 1)], abs=1e-7), (
                f"step {step} {metric}: {got[metric]} vs world-1 {want[metric]}"
            )


@pytest.mark.slow
def test_world1_values_match_the_hosts_critic_and_training_reduces_the_value_loss(model):
    for name, run in model["world1"].items():
        _assert_values_match_host(run["initial"], model["host"])
        first, second = run["history"]
        assert 0 < first["values_clipfrac"] < 1, "the test batch should clip some values"
        assert second["critic_loss"] < first["critic_loss"], name
        assert not torch.equal(run["final"], run["initial"])
    padded, packed = model["world1"]["padded"], model["world1"]["packed"]
    _assert_same_training(packed, padded)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_world1(model, name):
    world, layout, batching = LAYOUTS[name]
    run = _run(model["dir"], world, layout, batching)
    _assert_values_match_host(run["initial"], model["host"])
    _assert_same_training(run, model["world1"]["padded" if batching is PADDED else "packed"])


MOE_LAYOUTS = {
    "ep2": {"expert": 2},  # the trunk's dense parts DP2, the experts split two ways
    "tp2_ep2": {"tensor": 2, "sequence_parallel": True, "expert": 2, "expert_tensor": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MOE_LAYOUTS))
def test_moe_critic_layout_matches_world1_and_the_hosts_critic(moe_model, name):
    world1 = moe_model["world1"]["padded"]
    _assert_values_match_host(world1["initial"], moe_model["host"])
    assert world1["history"][1]["critic_loss"] < world1["history"][0]["critic_loss"]
    run = _run(moe_model["dir"], 2, MOE_LAYOUTS[name], PADDED)
    _assert_values_match_host(run["initial"], moe_model["host"])
    _assert_same_training(run, world1)


@pytest.mark.slow
def test_checkpoint_and_hf_export_saved_under_tp2_resume_under_pp2_and_world1(model, tmp_path):
    from safetensors.torch import load_file

    ckpt, export = str(tmp_path / "critic_ckpt"), tmp_path / "critic_hf"
    tp2 = {"tensor": 2, "sequence_parallel": True}
    saved = _run(model["dir"], 2, tp2, PADDED, steps=1, save_dir=ckpt, export_dir=str(export))
    resumed = _run(model["dir"], 2, {"pipeline": 2}, PADDED, steps=1, load_dir=ckpt)
    # the resumed critic scores exactly what the saved one did after its step
    assert (resumed["initial"] - saved["final"]).abs().max().item() <= VALUE_ATOL
    assert not torch.equal(resumed["initial"], model["world1"]["padded"]["initial"])
    # the export is the host's critic layout: trunk + value_head.weight, no LM head; a critic
    # started from it (not the policy's checkpoint) takes the trained head and scores the same
    tensors = load_file(export / "model.safetensors")
    assert tensors["value_head.weight"].shape == (1, 64) and "lm_head.weight" not in tensors
    from_export = _run(str(export), 1, {}, PADDED, steps=1, policy_path=model["dir"])
    assert (from_export["initial"] - saved["final"]).abs().max().item() <= VALUE_ATOL
