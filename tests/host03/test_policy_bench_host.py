"""The benchmark on its host, skyrl-train 0.3.1 (what the GPU machines run; bench/policy_bench.py speaks its
config keys and drives its FSDP2 workers): the CPU smoke run, variants' overrides, the FSDP2 cases'
settings, the benchmark batch through 0.3.1's training iterator, its HF wrapper loading SDPA.

The host-independent parts of the benchmark harness: tests/test_policy_bench.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_policy_bench import BENCH, _bench_module, _settings


def test_batch_converts_through_the_hosts_training_iterator():
    """The host's FSDP workers turn each training micro-batch into an `Experience` by key; the
    benchmark batch, after the keys the host's forward pass adds, must carry every key it reads
    (a missing `returns` failed every FSDP2 case of a GPU run)."""
    from skyrl_train.workers.worker_utils import BatchIterator

    from skyrl_megatron.testing.host_trainer import training_input

    bench = _bench_module()
    shape = bench.BatchShape(rows=4, prompt_tokens=8, min_response=2, max_response=16)
    data = training_input(bench.rl_batch(shape, vocab_size=100, pad_token_id=0), shape.max_response)
    # what `RayPPOTrainer.fwd_logprobs_values_reward` adds without a critic or a reference model
    data["action_log_probs"] = torch.zeros(shape.rows, shape.max_response)
    data["base_action_log_probs"] = None
    data["values"] = None
    experiences = list(BatchIterator(data, sample_batch_size=2))
    assert len(experiences) == 2
    assert torch.equal(experiences[0].returns, data["advantages"][:2])
    assert experiences[1].sequences.shape == (2, shape.prompt_tokens + shape.max_response)


def test_host_fsdp2_baseline_loads_hf_sdpa_where_it_would_pick_eager(tmp_path):
    """The host's HFModelWrapper picks flash_attention_2 or eager; the benchmark's FSDP2 baseline
    is HF SDPA (eager's [heads, L, L] scores ran out of memory on the GPU)."""
    from skyrl_megatron.activation import activate
    from skyrl_megatron.testing import make_tiny_hf_model

    activate()  # the host's model wrapper imports flash_attn's padding helpers (host compat fixes)
    from skyrl_train.model_wrapper import HFModelWrapper

    bench = _bench_module()
    make_tiny_hf_model("qwen3", tmp_path, seed=0)
    with bench.hf_sdpa_for_eager():
        wrapped = HFModelWrapper(str(tmp_path), use_flash_attention_2=False, bf16=False)
    assert wrapped.model.config._attn_implementation == "sdpa"
    unpatched = HFModelWrapper(str(tmp_path), use_flash_attention_2=False, bf16=False)
    assert unpatched.model.config._attn_implementation == "eager"


@pytest.mark.slow
def test_smoke_mode_runs_our_path_and_the_plain_loop_and_writes_the_report(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Benchmarks\n\nearlier text\n")
    out, chart = tmp_path / "report.json", tmp_path / "chart.png"
    profiles = tmp_path / "profiles"
    command = [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--markdown", str(markdown), "--chart", str(chart),
               "--profile", str(profiles), "--profile-backends", "megatron", "--profile-phase", "forward"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads(out.read_text())
    assert report["composed_only"] == ["fsdp2:world1", "fsdp2_sdpa:world1"]
    assert report["fsdp_packed_rows"] == 8 and report["fsdp_flash_attn"] is None  # nothing assembled on CPU
    case, loop, loop_dp2 = report["cases"]
    assert (case["case"], case["gpus"]) == ("megatron:tp2", 2)
    # the plain FSDP2 loop beside ours, on the same batch, world 1 and DP2: the same tokens, the same first
    # loss (every ratio 1 before the step, the advantages' token mean), every micro-batch count on both ranks
    assert [(r["case"], r["gpus"]) for r in (loop, loop_dp2)] == [("fsdp2_loop:world1", 1), ("fsdp2_loop:dp2", 2)]
    for r in (loop, loop_dp2):
        assert r["tokens"] == case["tokens"] and r["path"]["flash_attn"] == "SDPA per row (CPU)"
        assert len(r["phases"]["train"]["seconds"]) == 3
    # (each step scores first, so every ratio is 1 and the loss is the advantages' token mean at every step)
    losses = [float(line.rsplit("loss ", 1)[1]) for line in run.stdout.splitlines() if " step " in line and "loss " in line]
    assert len(losses) == 4 + 3 + 3 and max(losses) - min(losses) < 1e-4, losses
    path = case["path"]
    # the packed kernel the workers built with: masked SDPA on the CPU runtime (attention_kernel=auto)
    assert (path["transformer_engine"], path["attention"]) == (False, "ours (SDPA / masked SDPA)")
    assert path["torch_threads"] >= 1  # recorded: host-side thread pools were a GPU bottleneck
    # how the weights came, for the start-up time: through the bench's conversion cache, a fresh one (a miss)
    assert path["weights"]["hit"] is False and path["weights"]["conversion_seconds"] > 0
    assert f"megatron:tp2 started in {case['init_seconds']:.1f} s; weights: " in run.stdout
    # where the start-up went, stage by stage on each rank, in seconds after the driver asked for the workers
    assert len(case["startup"]) == 2
    startup_rank0 = case["startup"][0]
    for startup in case["startup"]:
        stages = [startup[name] for name in ("actor_init_entered", "actor_init_done", "process_group_done",
                                             "init_model_entered", "init_model_done")]
        assert 0 < stages[0] and stages == sorted(stages) and stages[-1] <= case["init_seconds"] + 0.1, startup
        assert startup["process_created"] <= stages[0] + 1.0  # (/proc's boot time has whole seconds)
    # the process groups form once the last rank is up: no rank finishes them before every actor has started
    assert min(s["process_group_done"] for s in case["startup"]) >= max(s["actor_init_done"] for s in case["startup"])
    assert "megatron:tp2 start-up, rank 0, s after the driver asked: {" in run.stdout
    # inside rank 0's process-group stage: the host config read, torch.distributed's default group, Megatron's
    # groups, the host's mesh rank and the failure registry
    inside = path["process_groups"]
    assert set(inside) == {"config", "torch_distributed", "megatron_groups", "mesh_and_registry"}
    assert all(v >= 0 for v in inside.values()), inside
    assert sum(inside.values()) <= startup_rank0["process_group_done"] - startup_rank0["actor_init_done"] + 0.1
    assert report["tokens"] == case["tokens"] > 0
    for phase in ("forward", "train"):
        measured = case["phases"][phase]
        assert len(measured["seconds"]) == report["steps"] == 3
        assert measured["median_seconds"] == sorted(measured["seconds"])[1]
        assert measured["tokens_per_s_per_gpu"] == pytest.approx(case["tokens"] / measured["median_seconds"] / 2)
        assert measured["mfu"] is None  # no GPU peak to measure against
        # the time inside the workers is part of the driver's
        assert len(measured["worker_seconds"]) == 3
        assert all(0 < w <= d for w, d in zip(measured["worker_seconds"], measured["seconds"]))
        # the allocator's calls per step and phase, on each rank (zeros on CPU: no CUDA allocator)
        assert measured["allocator_calls"] == [{"cuda_mallocs": 0, "cuda_frees": 0, "alloc_retries": 0}] * 3
    profile = case["profile"]
    assert profile["wall_seconds"] > 0 and profile["host_ops"] > 0 and profile["phase"] == "forward"
    table = Path(profile["file"]).read_text()
    assert Path(profile["file"]).parent == profiles and "top operators by host time" in table and "aten::" in table
    # the scoring pass alone: the runner's marked phases of a pass, with their wall times (no device on CPU, so
    # no idle analysis), and none of the training call's
    assert table.startswith("one scoring pass, rank 0: {") and "no device activity recorded" in table
    for phase in ("prepare_micro_batches", "schedule", "collect"):
        assert f"skyrl_megatron.{phase}" in table
    for phase in ("loss", "optimizer_step"):
        assert f"skyrl_megatron.{phase}" not in table
    assert [p.name for p in profiles.iterdir()] == ["profile_megatron_tp2.txt"]

    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n")
    # the path column names the kernels that ran: on CPU every fusion is off
    assert "| megatron:tp2 | ours (SDPA / masked SDPA), fused: none | train |" in text
    assert case["path"]["fused_kernels"] == []
    assert "| in worker, s |" in text
    assert "| fsdp2_loop:world1 | varlen (transformers attention interface), packed (SDPA per row (CPU)) | train |" in text
    assert "- megatron:tp2 vs fsdp2_loop:dp2 (plain FSDP2 loop): forward " in text
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_variant_adds_its_overrides_to_its_case_only(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    bench = _bench_module()
    make_tiny_hf_model("qwen3", tmp_path, seed=0)
    variants = {"swiglu": ["+trainer.policy.megatron_config.transformer_config_kwargs.bias_activation_fusion=true"]}
    settings = bench.Settings(str(tmp_path), bench.BatchShape(), str(tmp_path), cpu=True, token_budget=4096,
                              fsdp_micro_rows=2, recompute=False, steps=1, warmup=1, variants=variants)
    plain, fused = bench.Case.parse("megatron:tp2", variants), bench.Case.parse("megatron:tp2@swiglu", variants)
    assert fused.name == "megatron:tp2@swiglu"
    assert bench.host_overrides(fused, settings) == bench.host_overrides(plain, settings) + variants["swiglu"]
    cfg = bench.compose(fused, settings)
    assert cfg.trainer.policy.megatron_config.transformer_config_kwargs.bias_activation_fusion is True
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 2


def test_fsdp2_at_its_best_packs_with_flash_attention_and_the_padded_baseline_stays(tmp_path, monkeypatch):
    from skyrl_megatron.testing import make_tiny_hf_model

    bench = _bench_module()
    make_tiny_hf_model("qwen3", tmp_path, seed=0)
    settings = _settings(bench, tmp_path, fsdp_packed_rows=8, flash_attn_site="/standin")
    best, padded = bench.Case.parse("fsdp2:dp2"), bench.Case.parse("fsdp2_sdpa:dp2")
    cfg = bench.compose(best, settings)  # the host's and our validation accept it
    assert (cfg.trainer.strategy, cfg.trainer.flash_attn, cfg.trainer.use_sample_packing) == ("fsdp2", True, True)
    assert cfg.trainer.micro_train_batch_size_per_gpu == cfg.trainer.micro_forward_batch_size_per_gpu == 8
    assert cfg.trainer.gradient_checkpointing is False
    cfg = bench.compose(padded, settings)
    assert (cfg.trainer.flash_attn, cfg.trainer.use_sample_packing, cfg.trainer.micro_train_batch_size_per_gpu) == (False, False, 2)
    # rows never exceed the rows each GPU holds (dp2: 32 of the default 64)
    assert "trainer.micro_train_batch_size_per_gpu=32" in bench.host_overrides(bench.Case.parse("fsdp2:dp2"),
                                                                                _settings(bench, tmp_path, fsdp_packed_rows=64))
    # the stand-in goes first on PYTHONPATH for fsdp2 only
    monkeypatch.setenv("PYTHONPATH", "/a:/b")
    assert bench.case_environment(best, settings) == {"PYTHONPATH": "/standin:/a:/b"}
    assert bench.case_environment(padded, settings) == {}
    assert bench.case_environment(bench.Case.parse("megatron:world1"), settings) == {}
