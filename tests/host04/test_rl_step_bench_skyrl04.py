"""bench/rl_step_bench.py through skyrl 0.4's trainer (the CPU smoke run): the bench's settings reach this host
(ignore_eos through `additional_kwargs`, since 0.4 takes no new keys) and its step is reported whole. The same run on
skyrl-train 0.3.1, with every phase checked: tests/host03/test_rl_step_bench_host.py."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rl_step_bench.py"


def _bench(name: str):
    """A module of bench/ (not a package: its modules import each other by name)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH.parent))


def _checked_bench_config(strategy: str, settings, tmp_path):
    """What `strategy`'s process would hand skyrl 0.4 for `settings`, through our checks and the host's, with the
    shape's checkpoint config written where the bench writes it."""
    from skyrl_megatron.cli import checked_config

    model_dir = tmp_path / settings.checkpoint_name
    _bench("policy_bench").model_config(settings.model, settings.layers).save_pretrained(model_dir)
    return checked_config(_bench("rl_step_bench").run_config(strategy, settings, tmp_path / "run", model_dir, tmp_path))


@pytest.mark.slow
def test_smoke_run_through_skyrl04s_trainer(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(BENCH), "--smoke", "--strategies", "megatron", "--steps", "2", "--out", str(out),
               "--workdir", str(tmp_path / "work")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads((out / "rl_step.json").read_text())
    assert report["versions"]["host"] == "skyrl"
    result = report["strategies"]["megatron"]
    assert (result["exit"], result["complete"], result["measured_steps"], result["losses_finite"]) == (0, True, 2, True)
    # every reply max_tokens long: ignore_eos reached our engine through the host's additional_kwargs
    shape = report["settings"]["shape"]
    assert result["generated_tokens"] == shape["prompts"] * shape["samples"] * shape["max_tokens"] == 64
    for name in ("generate", "fwd_logprobs_values_reward", "policy_train", "sync_weights", "step"):
        assert all(seconds > 0 for seconds in result["phases"][name]["seconds"]), name
    assert result["train_inference_gap"] < 1e-3  # the engine sampled with the weights the policy then scored


def test_the_moe_run_with_r3_is_a_valid_skyrl04_config(tmp_path):
    """The GPU run for R3: Qwen3-30B-A3B's widths at 4 layers (`--layers 4`), the vLLM servers' routes replayed
    (`moe_config.routing_replay=r3`): our checks and the host's pass, the servers return routes on vLLM's mp
    executor, and the checkpoint the bench writes is that depth under its own name."""
    rl_step_bench = _bench("rl_step_bench")
    from skyrl_megatron.hosts import current

    args = rl_step_bench.parse_args(["--model", "Qwen3-30B-A3B", "--layers", "4", "--out", "x",
                                     "trainer.policy.megatron_config.moe_config.routing_replay=r3"])
    # as bench_settings makes them on a GPU machine (here, without a GPU, it would refuse the vLLM engines)
    settings = rl_step_bench.BenchSettings(model=args.model, shape=rl_step_bench.StepShape(), gpus=1, engine="vllm",
                                           token_budget=args.token_budget, steps=args.steps, warmup=args.warmup,
                                           extra=tuple(args.overrides), layers=args.layers)
    assert (settings.layers, settings.checkpoint_name, settings.model_label) == (
        4, "Qwen3-30B-A3B-4L", "Qwen3-30B-A3B, 4 layers")
    assert rl_step_bench.settings_record(settings)["layers"] == 4  # reports of other depths do not merge
    cfg = _checked_bench_config("megatron", settings, tmp_path)
    engine = cfg.generator.inference_engine
    assert engine.enable_return_routed_experts is True and engine.distributed_executor_backend == "mp"
    view = current().our_view(cfg)
    assert view.trainer.policy.megatron_config.moe_config.routing_replay == "r3"
    # ours without activation recompute, as the bench says, not skyrl 0.4's default (full recompute)
    from skyrl_megatron.config import MegatronWorkerConfig

    for role in ("policy", "ref"):
        overrides = MegatronWorkerConfig.from_host_config(view, role).transformer_overrides()
        assert "recompute_granularity" not in overrides and "recompute_num_layers" not in overrides, (role, overrides)

    with pytest.raises(SystemExit, match=r"--layers 0: must be positive"):
        rl_step_bench.bench_settings(rl_step_bench.parse_args(["--model", "Qwen3-30B-A3B", "--layers", "0", "--out", "x"]))


def test_separate_engines_are_a_valid_skyrl04_config_synced_by_nccl(tmp_path):
    """`--placement separate`: the engines on GPUs of their own, so the host's transfer is the NCCL broadcast, not
    CUDA IPC; the run takes twice `--gpus` GPUs (the report's device and per-GPU figures count them all)."""
    rl_step_bench = _bench("rl_step_bench")
    from skyrl.backends.skyrl_train.weight_sync import get_transfer_strategy

    from skyrl_megatron.hosts import current

    args = rl_step_bench.parse_args(["--model", "Qwen3-0.6B", "--gpus", "1", "--placement", "separate", "--out", "x"])
    settings = rl_step_bench.BenchSettings(model=args.model, shape=rl_step_bench.StepShape(), gpus=args.gpus,
                                           engine="vllm", token_budget=args.token_budget, steps=args.steps,
                                           warmup=args.warmup, placement=args.placement)
    assert settings.devices == 2 and rl_step_bench.settings_record(settings)["placement"] == "separate"
    cfg = _checked_bench_config("megatron", settings, tmp_path)
    placement, engine = cfg.trainer.placement, cfg.generator.inference_engine
    assert (placement.colocate_all, placement.colocate_policy_ref, placement.policy_num_gpus_per_node) == (False, True, 1)
    assert engine.num_engines == 1 and get_transfer_strategy(engine.weight_sync_backend, placement.colocate_all) == "nccl"
    assert current().our_view(cfg).trainer.strategy == "megatron"
    assert dataclasses.replace(settings, placement="colocated").devices == 1

    with pytest.raises(SystemExit, match=r"--placement separate needs GPUs"):
        rl_step_bench.bench_settings(rl_step_bench.parse_args(["--smoke", "--strategies", "megatron", "--placement",
                                                               "separate", "--out", "x"]))


def test_the_fsdp2_side_is_skyrl04s_fsdp_worker_at_its_best(tmp_path):
    """The FSDP2 strategy of the 4B comparison composes on skyrl 0.4 as on 0.3.1: the host's FSDP worker with
    FlashAttention-2 on packed rows, no activation checkpointing, micro-batches of about our token budget."""
    rl_step_bench = _bench("rl_step_bench")
    settings = rl_step_bench.BenchSettings(model="Qwen3-4B", shape=rl_step_bench.StepShape(), gpus=1, engine="vllm",
                                           token_budget=8192, steps=2, warmup=1)
    trainer = _checked_bench_config("fsdp2", settings, tmp_path).trainer
    train_rows, forward_rows = rl_step_bench.fsdp2_rows(settings)
    assert (train_rows, forward_rows) == (4, 16)  # Qwen3-4B: 4 packed rows fit one H200 in training
    assert trainer.strategy in ("fsdp", "fsdp2") and trainer.flash_attn is True
    assert trainer.remove_microbatch_padding is True and trainer.gradient_checkpointing is False
    assert (trainer.micro_train_batch_size_per_gpu, trainer.micro_forward_batch_size_per_gpu) == (train_rows, forward_rows)
