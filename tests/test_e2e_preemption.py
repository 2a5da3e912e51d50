"""End to end on CPU: a preempted run (SIGTERM to the driver) saves its step's checkpoint and exits 75, and
background checkpoints resume exactly, through the host trainer, our workers (DP=2) and the CPU engine.

Sampling is made reproducible across a restart (one batched generate call per step, seeded per request),
so two runs of the same steps train bitwise alike. Two runs of the demo command:

* A, uninterrupted: 3 steps, a checkpoint after every step, written in the background
  (`megatron_config.async_save`);
* B, a rerun from A's checkpoint of step 1 (A's run directory as it was then) that receives SIGTERM during
  step 2 (sent by the driver to itself as the step's generation starts), saving synchronously and keeping
  one checkpoint (`max_ckpts_to_keep=1`).

Asserted: B exits with `exit_codes.PREEMPTED`, saying which checkpoint to resume; it finished step 2 (its
metrics equal A's) and started no step 3; the host's pointer names step 2, whose checkpoint (written on
the signal) holds the same tensors, bitwise, as A's background checkpoint of step 2, and verifies, and step
1's was deleted before B exited; A's
pointer names its last checkpoint and no partial directory is left.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

TIMEOUT = 600
STEPS = 3
# DP=2 policy, no reference; reproducible sampling: the whole step in one engine call, seeded
OVERRIDES = [
    "trainer.placement.policy_num_gpus_per_node=2",
    "trainer.policy.megatron_config.tensor_model_parallel_size=1",
    "trainer.micro_train_batch_size_per_gpu=8",
    "trainer.micro_forward_batch_size_per_gpu=16",
    "trainer.algorithm.use_kl_loss=false",
    "generator.batched=true",
    "trainer.hf_save_interval=-1",
]


def _seeded_sampling() -> list[str]:
    """A seed in every sampling request, however the host hands engines settings it has no key for."""
    from skyrl_megatron.hosts import current

    return current().engine_sampling_overrides({"seed": 7})


# B's driver: the demo, whose trainer signals the driver (its own process) when step 2's generation starts
SIGNALLED_DEMO = """
import os, signal, sys
from skyrl_megatron.demo import __main__ as demo, experiment

checked = experiment._trainer_class

def signalled(*args):
    class SignalledTrainer(checked(*args)):
        async def generate(self, *args, **kwargs):
            if self.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return await super().generate(*args, **kwargs)
    return SignalledTrainer

experiment._trainer_class = signalled
sys.exit(demo.main(sys.argv[1:]))
"""


def _run(run_dir: Path, *extra: str, script: str | None = None) -> subprocess.CompletedProcess:
    command = ["-c", script] if script else ["-m", "skyrl_megatron.demo"]
    # without the demo's per-step weight comparison, as bench/checkpoint_steps.py runs it for step times
    return subprocess.run(
        [sys.executable, *command, "--out", str(run_dir), "--steps", str(STEPS), "--no-weight-check", *extra,
         *OVERRIDES, *_seeded_sampling()],
        capture_output=True, text=True, timeout=TIMEOUT,
    )


def _steps(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if "trainer/global_step" in r}


def _as_it_was_after_step_1(source: Path, target: Path) -> None:
    """A's run directory with only what existed once step 1 was saved."""
    def later_steps(directory, names):  # (skyrl-train 0.3.1 saves its final checkpoint one step further on)
        return [name for name in names if name.startswith("global_step_") and int(name.rpartition("_")[2]) > 1]

    shutil.copytree(source, target, ignore=later_steps)
    (target / "ckpts" / "latest_ckpt_global_step.txt").write_text("1")
    kept = [line for line in (source / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 1]
    (target / "metrics.jsonl").write_text("\n".join(kept) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("preemption")
    uninterrupted, preempted = work / "a", work / "b"
    a = _run(uninterrupted, "--ckpt-interval", "1", "trainer.policy.megatron_config.async_save=true")
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-5000:]
    _as_it_was_after_step_1(uninterrupted, preempted)
    # B keeps one checkpoint: step 1's is deleted (in the background) once step 2's is written
    b = _run(preempted, "--ckpt-interval", "100", "trainer.max_ckpts_to_keep=1", script=SIGNALLED_DEMO)
    return uninterrupted, preempted, b


def test_sigterm_saves_the_steps_checkpoint_and_exits_75(runs):
    from skyrl_megatron import exit_codes
    from skyrl_megatron.checkpoint import verify_checkpoint
    from skyrl_megatron.checkpoint.latest import read_latest

    uninterrupted, preempted, b = runs
    assert b.returncode == exit_codes.PREEMPTED, b.stdout[-3000:] + b.stderr[-5000:]
    assert "SIGTERM: finishing the current step" in b.stderr
    assert f"stopped after step 2 (SIGTERM received by the driver); its checkpoint is {preempted / 'ckpts'}/global_step_2" in b.stderr
    steps = _steps(preempted)
    assert sorted(steps) == [1, 2]  # step 2 finished, no step 3 started
    expected = _steps(uninterrupted)[2]
    for key in ("reward/avg_raw_reward", "policy/final_loss", "data/prompt_uids"):
        assert steps[2][key] == expected[key], key
    assert read_latest(preempted / "ckpts") == 2
    # max_ckpts_to_keep=1: the run waited for the deletion of step 1's checkpoint before it exited
    assert sorted(p.name for p in (preempted / "ckpts").iterdir() if p.is_dir()) == ["global_step_2"]
    # (a checkpoint's own step counts optimizer steps: two mini-batches per step here)
    saved = verify_checkpoint(preempted / "ckpts" / "global_step_2" / "policy")
    assert saved.step == verify_checkpoint(uninterrupted / "ckpts" / "global_step_2" / "policy").step == 4


def test_each_background_save_step_logs_the_workers_account_of_it(runs):
    """`timing/checkpoint_*` and `checkpoint/staged_gib` beside the host's `timing/save_checkpoints`: run A
    saves in the background at every step; each save's files (a tiny model's) are written long before the next
    step trains, so the next step publishes it as its training starts and its own save has nothing to finish."""
    uninterrupted, _, _ = runs
    steps = _steps(uninterrupted)
    # the step times are the host's own: the demo's weight comparison (--no-weight-check) did not run
    assert not any(key in record for record in steps.values() for key in ("sync/bitwise_equal", "timing/weight_check"))
    assert steps[1]["timing/checkpoint_previous_write"] == 0.0  # nothing was in flight before the first save
    for step in range(1, STEPS + 1):
        record = steps[step]
        assert record["timing/checkpoint_capture"] > 0 and record["checkpoint/staged_gib"] > 0, step
        assert record["timing/checkpoint_capture"] <= record["timing/save_checkpoints"], step
        assert record["timing/checkpoint_write"] == 0.0, step  # (a synchronous save's figure)
    assert "timing/checkpoint_publish" not in steps[1]
    for step in range(2, STEPS + 1):
        assert steps[step]["timing/checkpoint_previous_write"] > 0, step
        assert steps[step]["timing/checkpoint_publish"] > 0, step
        assert steps[step]["timing/checkpoint_finish_previous"] == 0.0, step


def test_the_checkpoint_written_on_the_signal_equals_the_uninterrupted_runs_background_one(runs, tmp_path):
    from skyrl_megatron.checkpoint.latest import read_latest
    from skyrl_megatron.testing.checkpoint_steps import global_tensors

    uninterrupted, preempted, _ = runs
    assert read_latest(uninterrupted / "ckpts") >= STEPS  # (skyrl-train 0.3.1: STEPS + 1)
    assert not [p for p in (uninterrupted / "ckpts").rglob(".*") if p.is_dir()]  # no partial save left
    written = global_tensors(preempted / "ckpts" / "global_step_2" / "policy", tmp_path / "b.pt")
    expected = global_tensors(uninterrupted / "ckpts" / "global_step_2" / "policy", tmp_path / "a.pt")
    assert written.keys() == expected.keys() and any("exp_avg" in key for key in written)
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key
