"""bench/rl_step_bench.py on its host, skyrl-train 0.3.1 (what the GPU machines run): the CPU smoke run end to
end (the report has every phase of the host's step, present and positive; no timing is asserted), the GPU run's
two strategies differing in the trainer backend only, and bad input named before anything runs."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "rl_step_bench.py"
sys.path.insert(0, str(ROOT / "bench"))  # the bench and its neighbours (policy_bench, gpu_examples)
import rl_step_bench  # noqa: E402

# the host's phases inside each step of the smoke run (not colocated, no reference worker)
SMOKE_PHASES = ("generate", "postprocess_generator_output", "convert_to_training_input", "fwd_logprobs_values_reward",
                "compute_advantages_and_returns", "train_critic_and_policy", "policy_train", "sync_weights", "step")


@pytest.mark.slow
def test_smoke_run_reports_every_phase_of_the_hosts_step(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, str(BENCH), "--smoke", "--strategies", "megatron", "--steps", "2", "--out", str(out),
               "--workdir", str(work)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads((out / "rl_step.json").read_text())
    assert list(report["strategies"]) == ["megatron"]
    result = report["strategies"]["megatron"]
    assert (result["exit"], result["complete"], result["measured_steps"], result["losses_finite"]) == (0, True, 2, True)
    phases = result["phases"]
    for name in SMOKE_PHASES:
        assert len(phases[name]["seconds"]) == 2 and all(s > 0 for s in phases[name]["seconds"]), name
        assert phases[name]["median"] == statistics.median(phases[name]["seconds"])
    # the host's phases fit inside its step; the remainder (no sleep or offload off the GPU) is small, not negative
    for step, untimed in zip(phases["step"]["seconds"], phases["untimed"]["seconds"]):
        assert -1e-3 < untimed < step
    assert phases["policy_train"]["median"] <= phases["train_critic_and_policy"]["median"]

    # every reply exactly max_tokens long (ignore_eos reached the engine), 4 prompts x 2 samples, plus the prompts
    shape = report["settings"]["shape"]
    rows, max_tokens = shape["prompts"] * shape["samples"], shape["max_tokens"]
    assert result["generated_tokens"] == rows * max_tokens == 64
    assert rows * (max_tokens + 10) < result["tokens"] < rows * (max_tokens + 40)
    assert result["tokens_per_s_per_gpu"] == pytest.approx(result["tokens"] / phases["step"]["median"])
    assert result["generated_tokens_per_s"] == pytest.approx(64 / phases["generate"]["median"])
    # the engine sampled with the weights the policy then scored (fp32 on CPU)
    assert result["train_inference_gap"] < 1e-3
    assert result["startup_seconds"] > 0 and result["device_memory_peak_gib"] is None  # no nvidia-smi on CPU
    # the logged steps: the warm-up and the two measured, each step's metrics and the run's log and overrides kept
    logged = [json.loads(line) for line in (out / "megatron" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in logged if "trainer/global_step" in r) == [1, 2, 3]
    assert "Started: 'step'" in (out / "megatron" / "run.log").read_text()
    overrides = json.loads((out / "megatron" / "overrides.json").read_text())
    assert "trainer.strategy=megatron" in overrides and "++generator.sampling_params.ignore_eos=true" in overrides

    # what identifies the measurement
    assert report["device"].startswith("CPU (") and report["run"]["commit"]
    assert report["run"]["command"] == "python bench/rl_step_bench.py " + " ".join(command[2:])
    assert report["versions"]["skyrl-train"] == "0.3.1"
    table = (out / "rl_step.md").read_text()
    assert "| **whole step** | " in table and "| weight sync | " in table and "| generated tokens/s | " in table

    # two runs' reports merge into one table with the ratio column; runs of other settings do not
    theirs = json.loads(json.dumps(report))
    theirs["strategies"] = {"fsdp2": theirs["strategies"].pop("megatron")}
    merged = rl_step_bench.merge_reports([report, theirs])
    assert list(merged["strategies"]) == ["megatron", "fsdp2"]
    assert "| fsdp2 / megatron |" in rl_step_bench.markdown(merged)
    assert f"| **whole step** | {phases['step']['median']:.2f} | {phases['step']['median']:.2f} | 1.00x |" in \
        rl_step_bench.markdown(merged)
    theirs["settings"] = {**theirs["settings"], "model": "Qwen3-4B"}
    with pytest.raises(SystemExit, match=r"differ in settings \(model\)"):
        rl_step_bench.merge_reports([report, theirs])


def _flat(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        return {key: value for k, v in node.items() for key, value in _flat(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): node}


def test_the_gpu_runs_differ_in_the_trainer_backend_only(tmp_path):
    """Qwen3-4B on one GPU: both configs pass our checks and the host's; generation, batch, algorithm and
    placement are the same; FSDP2 is at its best (flash-attn packing, no activation checkpointing, micro-batches
    of our token budget's size, capped where 4B ran out of memory)."""
    from omegaconf import OmegaConf

    from skyrl_megatron.cli import checked_config

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copyfile(rl_step_bench.MODEL_CONFIGS / "Qwen3-4B.json", model_dir / "config.json")
    settings = rl_step_bench.BenchSettings(model="Qwen3-4B", shape=rl_step_bench.StepShape(), gpus=1, engine="vllm",
                                           token_budget=8192, steps=6, warmup=1)
    configs = {}
    for strategy in ("megatron", "fsdp2"):
        cfg = checked_config(rl_step_bench.run_config(strategy, settings, tmp_path / strategy, model_dir, tmp_path))
        configs[strategy] = _flat(OmegaConf.to_container(cfg, resolve=True))
    ours, theirs = configs["megatron"], configs["fsdp2"]
    differ = {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}
    backend = {"trainer.strategy", "trainer.micro_train_batch_size_per_gpu", "trainer.micro_forward_batch_size_per_gpu"}
    ignored_by_fsdp2 = ("trainer.policy.megatron_config.", "trainer.ref.megatron_config.")
    # each strategy's run directory (checkpoints, exports, prompt file) is its own
    own_dirs = {"trainer.ckpt_path", "trainer.export_path", "data.train_data"}
    assert {key for key in differ if not key.startswith(ignored_by_fsdp2)} - own_dirs == backend
    for strategy, flat in configs.items():  # what both share, by value
        assert flat["trainer.placement.colocate_all"] is True and flat["generator.backend"] == "vllm", strategy
        assert (flat["generator.sampling_params.ignore_eos"], flat["generator.sampling_params.max_generate_length"],
                flat["generator.n_samples_per_prompt"], flat["trainer.train_batch_size"],
                flat["trainer.policy_mini_batch_size"]) == (True, 1024, 8, 16, 8)
        assert flat["trainer.algorithm.use_kl_loss"] is True and flat["generator.gpu_memory_utilization"] == 0.5
    assert (theirs["trainer.strategy"], theirs["trainer.flash_attn"], theirs["trainer.use_sample_packing"],
            theirs["trainer.gradient_checkpointing"]) == ("fsdp2", True, True, False)
    # 4B: 4 training rows (8 ran out of memory on one H200), 16 scoring rows; the mini-batch's 64 rows divide by 4
    assert (theirs["trainer.micro_train_batch_size_per_gpu"], theirs["trainer.micro_forward_batch_size_per_gpu"]) == (4, 16)
    for role in ("policy", "ref"):
        assert ours[f"trainer.{role}.megatron_config.max_tokens_per_microbatch"] == 8192
        assert ours[f"trainer.{role}.megatron_config.tensor_model_parallel_size"] == 1
    # a shape without a recorded limit: FSDP2 packs about our budget (8 rows of ~1k tokens), scoring 4x
    assert rl_step_bench.fsdp2_rows(dataclasses.replace(settings, model="Qwen3-0.6B")) == (8, 31)


@pytest.mark.parametrize(("argv", "message"), [
    (["--smoke", "--strategies", "megatron,fsdp2"], "FSDP2 workers cannot"),
    (["--strategies", "megatron,deepspeed"], "deepspeed not one of megatron, fsdp2"),
    (["--model", "Qwen3-5B"], "--model Qwen3-5B: no .*Qwen3-5B.json; one of Qwen3-0.6B"),
    (["--prompts", "15"], "must split into --optimizer-steps 2"),
    (["--smoke"], "--out DIR is required"),
])
def test_bad_input_is_named_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        rl_step_bench.main([*argv, *([] if "--smoke" in argv and len(argv) == 1 else ["--out", str(tmp_path)])])
    assert not (tmp_path / "rl_step.json").exists()
