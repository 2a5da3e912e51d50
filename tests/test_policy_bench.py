"""The benchmark harness (bench/policy_bench.py): its CPU smoke mode end to end, and its parts.

The smoke run is the harness's real code path on tiny shapes: the host trainer builds our policy
group at TP=2 through Ray, scores and trains the long-tailed batch, and the report, the markdown
section and the chart are written. The host's FSDP2 workers need CUDA; on CPU their case is
composed and validated only, and the report says so. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "policy_bench.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("policy_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["policy_bench"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_mode_runs_our_path_and_writes_the_report(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Benchmarks\n\nearlier text\n")
    out, chart = tmp_path / "report.json", tmp_path / "chart.png"
    profiles = tmp_path / "profiles"
    command = [sys.executable, str(BENCH), "--smoke", "--out", str(out), "--markdown", str(markdown), "--chart", str(chart),
               "--profile", str(profiles), "--profile-backends", "megatron"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    report = json.loads(out.read_text())
    assert report["composed_only"] == ["fsdp2:world1"]
    (case,) = report["cases"]
    assert (case["case"], case["gpus"]) == ("megatron:tp2", 2)
    assert case["path"] == {"transformer_engine": False, "attention": "ours (SDPA / varlen)"}
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
    profile = case["profile"]
    assert profile["wall_seconds"] > 0 and profile["host_ops"] > 0
    table = Path(profile["file"]).read_text()
    assert Path(profile["file"]).parent == profiles and "top operators by host time" in table and "aten::" in table
    assert [p.name for p in profiles.iterdir()] == ["profile_megatron_tp2.txt"]

    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n")
    assert "| megatron:tp2 | ours (SDPA / varlen) | train |" in text
    assert "| in worker, s |" in text
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_section_is_replaced_not_repeated(tmp_path):
    bench = _bench_module()
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    bench.replace_section(page, "m x1", "first\n")
    bench.replace_section(page, "other x1", "other\n")
    bench.replace_section(page, "m x1", "second\n")
    text = page.read_text()
    assert "first" not in text and text.count("second") == 1 and "other" in text
    assert text.index("second") < text.index("other")  # kept its place


def test_batch_is_rl_shaped_with_a_long_tail():
    bench = _bench_module()
    shape = bench.BatchShape(rows=512, prompt_tokens=256, min_response=64, max_response=4096, seed=3)
    batch = bench.rl_batch(shape, vocab_size=1000, pad_token_id=0)
    mask = batch["attention_mask"]
    assert mask.shape == (512, 256 + 4096)
    prompts, responses = mask[:, :256].sum(1), mask[:, 256:].sum(1)
    assert prompts.min() >= 192 and prompts.max() <= 256
    assert responses.min() >= 64 and responses.max() <= 4096
    # prompts end at the response boundary (left padding); responses start there (right padding)
    assert bool((mask[:, 255] == 1).all() and (mask[:, 256] == 1).all())
    assert torch.equal(batch["loss_mask"], mask[:, 256:])
    assert bool((batch["sequences"][mask == 0] == 0).all())
    # log-uniform: the median sits near the geometric mean of the bounds, the mean well above it
    median, mean = responses.float().median().item(), responses.float().mean().item()
    assert median == pytest.approx(math.sqrt(64 * 4096), rel=0.15)
    assert mean > 1.5 * median


def test_flops_of_a_dense_model_by_hand():
    from skyrl_megatron.planner.arch import ModelArch

    bench = _bench_module()
    config = json.loads((ROOT / "examples/megatron/model_configs/Qwen3-1.7B.json").read_text())
    arch = ModelArch.from_hf_config(config)
    mask = torch.zeros(2, 10, dtype=torch.long)
    mask[0, :4] = 1
    mask[1, :10] = 1
    h, layers, heads, kv, d, f, vocab = 2048, 28, 16, 8, 128, 6144, 151936
    per_token = layers * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * f) + vocab * h
    expected = 2 * per_token * 14 + 2 * layers * heads * d * (4**2 + 10**2)
    assert bench.forward_flops(arch, mask) == pytest.approx(expected, rel=1e-12)


def test_bad_cases_are_refused_with_the_fix():
    bench = _bench_module()
    with pytest.raises(SystemExit, match="layout 'tp3' is not one of"):
        bench.Case.parse("megatron:tp3")
    with pytest.raises(SystemExit, match="backend 'deepspeed' is not megatron or fsdp2"):
        bench.Case.parse("deepspeed:world1")
    with pytest.raises(SystemExit, match="FSDP2 path has no tp2; use world1, dp2 or dp4"):
        bench.Case.parse("fsdp2:tp2")
    with pytest.raises(SystemExit, match="variant 'fused' is not defined; add --variant fused="):
        bench.Case.parse("megatron:world1@fused")


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


def test_render_writes_the_section_from_a_saved_report_and_names_failed_cases(tmp_path):
    bench = _bench_module()
    phase = {"seconds": [2.0, 1.0, 3.0], "median_seconds": 2.0, "tokens_per_s_per_gpu": 500.0, "mfu": 0.25, "peak_gib": 10.0}
    ours = {"case": "megatron:world1", "backend": "megatron", "layout": "world1", "variant": "", "gpus": 1,
            "path": {"transformer_engine": False, "attention": "ours (SDPA / varlen)"},
            "phases": {"forward": phase, "train": {**phase, "tokens_per_s_per_gpu": 250.0, "peak_gib": 20.0}}}
    theirs = {**ours, "case": "fsdp2:world1", "backend": "fsdp2",
              "phases": {"forward": {**phase, "tokens_per_s_per_gpu": 100.0, "peak_gib": 20.0},
                         "train": {**phase, "tokens_per_s_per_gpu": 125.0, "peak_gib": 40.0}}}
    report = {"model": "Qwen3-1.7B", "device": "NVIDIA H200", "max_gpus": 1, "date": "2026-11-21", "command": "c",
              "batch": {"rows": 64, "prompt_tokens": 256, "min_response": 64, "max_response": 4096},
              "tokens": 1000, "peak_tflops": 700.0, "recompute": False, "token_budget": 8192, "fsdp_micro_rows": 2,
              "variants": {}, "steps": 3, "warmup": 1, "cases": [ours, theirs], "composed_only": [],
              "failed": {"megatron:world1@big": "RayTaskError(OutOfMemoryError): \x1b[36mray::Worker.ppo_train()\x1b[39m\n"
                                                "  File \"x.py\", line 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB |x"}}
    saved, page = tmp_path / "report.json", tmp_path / "benchmarks.md"
    saved.write_text(json.dumps(report))
    assert bench.main(["--render", str(saved), "--markdown", str(page)]) == 0
    text = page.read_text()
    assert "at most 8192 tokens each; FSDP2 padded, 2 rows each" in text
    assert "| megatron:world1@big | - | failed: torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB /x | - |" in text
    assert "- megatron:world1 vs fsdp2:world1: forward 5.00x speed, 0.50x memory, train 2.00x speed, 0.50x memory" in text
