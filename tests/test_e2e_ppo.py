"""End to end on CPU: PPO with GAE through the host trainer, policy, ref and critic on Megatron.

On skyrl 0.4 (the default environment); tests/host03 runs the same tests on skyrl-train 0.3.1.

One run of the demo command with ``--ppo`` (``python -m skyrl_megatron.demo --ppo``): the policy on
2 ranks (TP=2 + SP), a reference worker, a Megatron critic on 1 rank started from the policy's
checkpoint with a fresh value head, and the CPU engine. The host computes GAE advantages from our
critic's values and trains both models every step.

Asserted:
* the mean reward of the last three steps beats the first three by REWARD_MARGIN;
* the critic's updates lower the host's value loss on the data they train on (measured on each step's
  batch with the values GAE used and again after the update; the loss from step to step moves with the
  rewards' spread, which the policy changes, so it is no measure of the critic): on most steps, and by
  VALUE_LOSS_DROP in the geometric mean of the steps' after/before ratios; the critic took one optimizer step
  per mini-batch every step;
* the engine holds the policy's weights bitwise after every sync;
* the critic's checkpoint is complete and its HF export is the host's critic layout (trunk +
  ``value_head.weight``, no LM head).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.skyrl_0_4 import SkyRL04

pytestmark = pytest.mark.slow

STEPS = 10
CKPT_INTERVAL = 5
# The rise differs a lot between machines (sampling differs): on skyrl-train 0.3.1 the dev box measured
# rises of 0.72 (seed 42) and 0.66, 0.63, 0.79 (trainer.seed 1, 2, 3), the CI machine 0.29 (0.11 -> 0.40,
# 2026-11-27). A policy that does not learn stays near its start: its first three steps spread by about 0.03.
REWARD_MARGIN = 0.15
# The per-step ratio after/before the update, in five 10-step runs on the dev box (2026-11-29, both hosts; the
# runs are not reproducible on CPU): the loss fell on 7-9 steps of 10; the ratios' geometric mean was 0.57-0.91;
# single steps reached 1.85. The ratio of the run's mean losses after/before (0.63-0.91), dominated by the few
# high-loss steps, and the arithmetic mean of the ratios (0.66-0.97, moved by one outlier) each failed a bound in
# one run of the five; the geometric mean treats a halving and a doubling alike. A critic that does not learn
# gives ratios of 1 (lr 0: exactly), one that steps the wrong way ratios above 1. A full suite's skyrl-train 0.3.1
# leg on the 2-core box (2026-12-07) gave 0.956, the loss lower on the first six steps (0.81-1.00): the bound sits near 1 to
# tell a learning critic from those, not to rank how fast it learns.
VALUE_LOSS_DROP = 0.02
MIN_STEPS_LOWERED = 6
TIMEOUT = 900


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    from skyrl_megatron.demo.experiment import read_metrics

    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    out = subprocess.run(
        [sys.executable, "-m", "skyrl_megatron.demo", "--ppo", "--out", str(run_dir), "--steps", str(STEPS),
         "--ckpt-interval", str(CKPT_INTERVAL)],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    final = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "trainer/global_step" in r}
    return {"run_dir": run_dir, "steps": [final[s] for s in sorted(final)], "stdout": out.stdout}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_reward_rises_and_the_critics_updates_lower_the_value_loss(ppo_run):
    steps = ppo_run["steps"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    rewards = [r["reward/avg_raw_reward"] for r in steps]
    assert _mean(rewards[-3:]) >= _mean(rewards[:3]) + REWARD_MARGIN, rewards
    before = [r["critic/value_loss_before_update"] for r in steps]
    after = [r["critic/value_loss_after_update"] for r in steps]
    ratios = [a / b for a, b in zip(after, before)]
    assert sum(r < 1 for r in ratios) >= MIN_STEPS_LOWERED, ratios
    assert math.exp(_mean([math.log(r) for r in ratios])) <= 1 - VALUE_LOSS_DROP, ratios
    counts_updates = not isinstance(current(), SkyRL04)  # 0.3.1's ppo_train counts its steps; 0.4 steps by call
    for record in steps:
        if counts_updates:
            assert record["critic/critic_update_steps"] == 2  # two mini-batches per step
            assert record["critic/critic_skipped_steps"] == 0
        assert record["sync/bitwise_equal"] == 1.0
    assert "PPO (GAE)" in ppo_run["stdout"] and "before the critic's update" in ppo_run["stdout"]


def test_critic_checkpoint_is_complete_and_its_export_is_the_hosts_critic_layout(ppo_run):
    from safetensors.torch import load_file

    from skyrl_megatron.checkpoint import verify_checkpoint

    run_dir: Path = ppo_run["run_dir"]
    for step_dir in sorted((run_dir / "ckpts").glob("global_step_*")):
        verify_checkpoint(step_dir / "critic")
    export = next((run_dir / "exports").glob("global_step_*")) / "critic"
    tensors = load_file(export / "model.safetensors")
    assert tensors["value_head.weight"].shape == (1, 64)
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
