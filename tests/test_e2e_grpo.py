"""End to end on CPU: GRPO through the host trainer, our Megatron workers, Ray and the CPU engine.

On skyrl 0.4 (the default environment); tests/host03 runs the same tests on skyrl-train 0.3.1.

One run of the demo command (``python -m skyrl_megatron.demo``, what ``make demo`` runs) with a
policy on 2 ranks (TP=2 + SP), a reference worker and a CPU engine that gets the policy's weights
through the host's broadcast sender after every step. The run is interrupted by killing a policy
worker with SIGKILL; the same command then resumes it from the last checkpoint to the end.

Asserted:
* the killed run exits non-zero naming the dead worker (role, rank, pid); every checkpoint the
  host points at is complete;
* the resumed run starts at the step after the last checkpoint and repeats it with the same prompts
  (the data order survives the restart); over the whole run every prompt is used exactly once;
* after every sync the engine's weights equal a fresh export of the policy, bitwise (SHA-256 per
  tensor, all 47 of them);
* the logprobs the engine reported while sampling equal the trainer's ``forward`` on the same tokens
  within 1e-4 (fp32);
* the mean reward of the last three steps beats the first three by REWARD_MARGIN;
* the final HF export loads in transformers and holds the trained (not the initial) weights;
* the console shows the banner, the step table and the summary, and at most CONSOLE_EXTRA_LINES others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 10
CKPT_INTERVAL = 2
KILL_AFTER_STEP = 3  # a checkpoint exists at step 2; the kill lands during step 4
# Sampling diverges between machines (float reductions differ), so the margin must hold for any
# trajectory, not one. Measured without interruption, trainer.seed 1, 2, 3 (steps 1-3 -> 8-10):
# 0.12 -> 0.79, 0.13 -> 0.80, 0.07 -> 0.80; at the previous lr (3e-3) a CI machine saw 0.14 -> 0.18.
REWARD_MARGIN = 0.3
LOGPROB_TOLERANCE = 1e-4
NUM_EXPORTED_TENSORS = 47  # tiny Qwen3: 4 layers x 11 + embeddings, final norm, lm_head
TIMEOUT = 900
CONSOLE_EXTRA_LINES = 10
_SUMMARY_PREFIXES = ("skyrl-megatron demo:", "run directory:", "done in ", "weight sync bitwise equal", "checkpoint:",
                     "HF export:", "reward plot:")


def _demo(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "skyrl_megatron.demo", "--out", str(run_dir), "--steps", str(STEPS),
         "--ckpt-interval", str(CKPT_INTERVAL)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _records(run_dir: Path) -> list[dict]:
    from skyrl_megatron.demo.experiment import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if "trainer/global_step" in r]


def _policy_worker_pids(demo: subprocess.Popen) -> list[int]:
    """The demo's policy workers: Ray starts them under the raylet the demo started. Only its own, so
    that another Ray run on the machine (a second test session) is never counted or killed."""
    pids = []
    for process in psutil.Process(demo.pid).children(recursive=True):
        try:
            cmdline = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            continue
        if cmdline.startswith("ray::MegatronPolicyWorker"):
            pids.append(process.pid)
    return sorted(pids)


def _latest_checkpoint(run_dir: Path) -> int:
    return int((run_dir / "ckpts" / "latest_ckpt_global_step.txt").read_text().strip())


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    first = _demo(run_dir)
    deadline = time.monotonic() + TIMEOUT
    while KILL_AFTER_STEP not in _steps(_records(run_dir)):
        assert first.poll() is None, f"demo ended before step {KILL_AFTER_STEP}:\n{first.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, "demo too slow"
        time.sleep(0.5)
    victims = _policy_worker_pids(first)
    assert len(victims) == 2, victims  # TP=2
    victim = victims[-1]
    os.kill(victim, signal.SIGKILL)
    _, first_stderr = first.communicate(timeout=300)
    first_records = _records(run_dir)
    checkpoint_at_failure = _latest_checkpoint(run_dir)

    second = _demo(run_dir)
    second_stdout, second_stderr = second.communicate(timeout=TIMEOUT)
    assert second.returncode == 0, second_stdout[-3000:] + second_stderr[-5000:]
    return {
        "run_dir": run_dir,
        "victim": victim,
        "first_returncode": first.returncode,
        "first_stderr": first_stderr,
        "first_records": first_records,
        "checkpoint_at_failure": checkpoint_at_failure,
        "all_records": _records(run_dir),
        "second_stdout": second_stdout,
        "second_stderr": second_stderr,
    }


def test_killed_worker_fails_the_run_by_name_and_leaves_only_complete_checkpoints(interrupted_then_resumed):
    from skyrl_megatron.checkpoint import verify_checkpoint

    run = interrupted_then_resumed
    assert run["first_returncode"] == 1, run["first_stderr"][-3000:]
    message = run["first_stderr"]
    assert "policy worker rank" in message and f"pid {run['victim']}" in message, message[-3000:]
    # checkpoints the host can resume from are complete (the resumed run below used one)
    for step_dir in sorted((run["run_dir"] / "ckpts").glob("global_step_*")):
        verify_checkpoint(step_dir / "policy")


def test_resume_continues_after_the_last_checkpoint_with_the_same_data_order(interrupted_then_resumed):
    run = interrupted_then_resumed
    first_steps = _steps(run["first_records"])
    assert first_steps[:KILL_AFTER_STEP] == list(range(1, KILL_AFTER_STEP + 1))
    resumed = [r for r in run["all_records"][len(run["first_records"]):] if "trainer/global_step" in r]
    resumed_from = run["checkpoint_at_failure"]
    assert resumed_from >= CKPT_INTERVAL and resumed_from % CKPT_INTERVAL == 0
    assert [r["step"] for r in resumed] == list(range(resumed_from + 1, STEPS + 1))
    first_by_step = {r["step"]: r for r in run["first_records"] if "trainer/global_step" in r}
    repeated = [r for r in resumed if r["step"] in first_by_step]
    assert repeated, "the resumed run should repeat the step the kill interrupted"
    for record in repeated:
        assert record["data/prompt_uids"] == first_by_step[record["step"]]["data/prompt_uids"]
    # over the finished run (each step's last record), every prompt exactly once
    final = {r["step"]: r for r in run["all_records"] if "trainer/global_step" in r}
    uids = [uid for step in sorted(final) for uid in final[step]["data/prompt_uids"]]
    assert sorted(uids, key=int) == [str(i) for i in range(len(uids))] and len(uids) == STEPS * 8


def test_engine_holds_the_policy_weights_bitwise_and_reports_the_trainers_logprobs(interrupted_then_resumed):
    steps = [r for r in interrupted_then_resumed["all_records"] if "trainer/global_step" in r]
    assert len(steps) >= STEPS
    for record in steps:
        assert record["sync/bitwise_equal"] == 1.0, record["step"]
        assert record["sync/tensors"] == NUM_EXPORTED_TENSORS
        # the CPU engine's comparison runs inside the host's scoring phase, and says how long it took there
        assert 0 < record["timing/weight_check"] < record["timing/fwd_logprobs_values_reward"], record
        assert record["sync/rollout_logprob_max_diff"] <= LOGPROB_TOLERANCE, record


def test_reward_goes_up_and_the_final_export_holds_the_trained_policy(interrupted_then_resumed):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = interrupted_then_resumed
    final = {r["step"]: r["reward/avg_raw_reward"] for r in run["all_records"] if "trainer/global_step" in r}
    rewards = [final[s] for s in sorted(final)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + REWARD_MARGIN, rewards

    export = next((run["run_dir"] / "exports").glob("global_step_*")) / "policy"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    initial = load_file(run["run_dir"] / "model" / "model.safetensors")
    trained = dict(model.named_parameters())
    assert set(initial) <= set(trained)
    assert any(not torch.equal(initial[name], trained[name]) for name in initial)
    assert "reward plot" in run["second_stdout"] and (run["run_dir"] / "reward.png").stat().st_size > 0


def test_lora_demo_syncs_adapters_to_the_engine_by_one_override_more(tmp_path):
    """`trainer.policy.model.lora.rank=8` turns the demo into LoRA training (merged sync by default, see
    the README); with `weight_sync=adapters` the worker writes a PEFT directory each step, the engine
    merges it (engines/lora_merge.py), and still holds exactly the trainer's merged weights."""
    run_dir = tmp_path / "lora"
    out = subprocess.run(
        [sys.executable, "-m", "skyrl_megatron.demo", "--out", str(run_dir), "--steps", "2",
         "trainer.policy.model.lora.rank=8",
         "trainer.policy.megatron_config.lora_config.weight_sync=adapters",
         f"trainer.policy.model.lora.lora_sync_path={run_dir / 'lora_sync'}"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    steps = [r for r in _records(run_dir) if "trainer/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["sync/bitwise_equal"] == 1.0
        assert record["sync/rollout_logprob_max_diff"] <= LOGPROB_TOLERANCE
        assert 0 < record["policy/lora/trainable_fraction"] < 0.2
    assert (run_dir / "lora_sync" / "adapter_config.json").exists()


def _is_demo_line(line: str) -> bool:
    """The banner, the step table (header and one row of numbers per step) and the summary."""
    words = line.split()
    if line.startswith(_SUMMARY_PREFIXES) or words[:2] == ["step", "reward"]:
        return True
    return bool(words) and words[0].isdigit() and len(words) > 4


def test_the_console_shows_the_step_table_and_little_else(interrupted_then_resumed):
    run = interrupted_then_resumed
    lines = [line for line in (run["second_stdout"] + run["second_stderr"]).splitlines() if line.strip()]
    steps = [line for line in lines if line.split() and line.split()[0].isdigit()]
    assert len(steps) >= STEPS - interrupted_then_resumed["checkpoint_at_failure"], lines
    extra = [line for line in lines if not _is_demo_line(line)]
    assert len(extra) <= CONSOLE_EXTRA_LINES, "\n".join(extra)
