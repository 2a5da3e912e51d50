"""The benchmark harness (bench/policy_bench.py): its CPU smoke mode end to end, and its parts.

The smoke run is the harness's real code path on tiny shapes: the host trainer builds our policy
group at TP=2 through Ray, scores and trains the long-tailed batch, and the report, the markdown
section and the chart are written. The host's FSDP2 workers need CUDA; on CPU their cases (at its
best, and the padded SDPA defaults) are composed and validated only, and the report says so. No
timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
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
    with pytest.raises(SystemExit, match="backend 'deepspeed' is not one of megatron, fsdp2, fsdp2_sdpa, fsdp2_loop"):
        bench.Case.parse("deepspeed:world1")
    with pytest.raises(SystemExit, match="FSDP2 path has no tp2; use world1, dp2 or dp4"):
        bench.Case.parse("fsdp2:tp2")
    with pytest.raises(SystemExit, match="FSDP2 path has no tp2; use world1, dp2 or dp4"):
        bench.Case.parse("fsdp2_loop:tp2")
    with pytest.raises(SystemExit, match="FSDP2 path has no ep2; use world1, dp2 or dp4"):
        bench.Case.parse("fsdp2_sdpa:ep2")
    with pytest.raises(SystemExit, match="variant 'fused' is not defined; add --variant fused="):
        bench.Case.parse("megatron:world1@fused")


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


def _gpu_idle_module():
    spec = importlib.util.spec_from_file_location("gpu_idle", ROOT / "bench" / "gpu_idle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_idle"] = module
    spec.loader.exec_module(module)
    return module


def test_the_path_cell_names_what_ran_the_experts_gemms_on_either_side():
    """A MoE row says which library ran the experts' GEMMs: ours from `BuiltModel.expert_gemms`, the host's from
    transformers' experts kernel; a dense row names none."""
    bench = _bench_module()
    ours = {"attention": "ours (SDPA / flash4)", "transformer_engine": False, "fused_kernels": ["rope", "swiglu"]}
    assert bench.path_cell({**ours, "expert_gemms": "quack"}) == "ours (SDPA / flash4), fused: rope swiglu, experts: quack"
    assert bench.path_cell({**ours, "expert_gemms": "torch"}).endswith(", experts: torch")
    assert "experts" not in bench.path_cell({**ours, "expert_gemms": None})
    host = {"attention": "flash_attention_2", "transformer_engine": False, "sample_packing": True, "experts": "grouped_mm"}
    assert bench.path_cell(host) == "flash_attention_2, packed, experts: grouped_mm"


def test_idle_gaps_are_attributed_to_the_host_operation_running_then():
    gpu_idle = _gpu_idle_module()
    HostOp = gpu_idle.HostOp
    kernels = [(0, 10), (5, 20), (100, 110), (120, 130)]  # gaps: 20-100 (long), 110-120 (short)
    host = [
        HostOp("outer", 0, 200, thread=1),
        HostOp("aten::nonzero", 30, 90, thread=1, frame="skyrl_megatron/compute/microbatch/inputs.py(9): pack"),
        HostOp("aten::mm", 95, 99, thread=2),  # ends before the gap's middle (60)
    ]
    marked = [HostOp("skyrl_megatron.schedule", 0, 200, thread=1), HostOp("skyrl_megatron.loss", 100, 125, thread=1)]
    report = gpu_idle.idle_report(kernels, host, marked, min_gap_us=50)
    assert (report.span_us, report.busy_us, report.idle_us) == (130, 40, 90)
    assert (report.small_gaps, report.small_gaps_us) == (1, 10)
    key = "aten::nonzero @ skyrl_megatron/compute/microbatch/inputs.py(9): pack  [in skyrl_megatron.schedule]"
    assert dict(report.attributed) == {key: [80, 1]}
    assert report.ranges["skyrl_megatron.schedule"] == [200, 40, 1]
    assert report.ranges["skyrl_megatron.loss"] == [25, 15, 1]  # 100-110 and 120-125
    text = report.render()
    assert "kernels busy 0.0 ms (31%)" in text and key in text


def test_first_frame_is_ours_megatrons_or_the_hosts():
    gpu_idle = _gpu_idle_module()
    stack = ["torch/nn/modules/module.py(1): _call_impl", "/x/site-packages/megatron/core/models/gpt/gpt_model.py(5): forward"]
    assert gpu_idle.first_frame(stack) == "megatron/core/models/gpt/gpt_model.py(5): forward"
    assert gpu_idle.first_frame(["torch/a.py(1): f"]) == ""


def test_a_variant_can_set_environment_variables_for_its_case(tmp_path, monkeypatch):
    bench = _bench_module()
    variants = {"seg": ["env:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "+trainer.seed=7"]}
    settings = bench.Settings(str(tmp_path), bench.BatchShape(), str(tmp_path), cpu=True, token_budget=4096,
                              fsdp_micro_rows=2, recompute=False, steps=1, warmup=1, variants=variants)
    case, plain = bench.Case.parse("megatron:world1@seg", variants), bench.Case.parse("megatron:world1", variants)
    assert bench.host_overrides(case, settings) == bench.host_overrides(plain, settings) + ["+trainer.seed=7"]
    assert bench.case_environment(case, settings) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert bench.case_environment(plain, settings) == {}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with bench.environment(bench.case_environment(case, settings)):
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def _settings(bench, model_dir, **kwargs):
    return bench.Settings(str(model_dir), bench.BatchShape(), str(model_dir), cpu=True, token_budget=8192,
                          fsdp_micro_rows=2, recompute=False, steps=1, warmup=1, **kwargs)


def test_fsdp2_rows_default_to_our_token_budget_on_average():
    bench = _bench_module()
    shape = bench.BatchShape()
    mask = bench.rl_batch(shape, vocab_size=1000, pad_token_id=0)["attention_mask"]
    mean_row = float(mask.sum()) / shape.rows  # ~1.1k tokens
    rows = bench.token_budget_rows(mask, 8192)
    assert rows == 8 and shape.rows % rows == 0
    assert abs(rows * mean_row - 8192) < abs(16 * mean_row - 8192) and abs(rows * mean_row - 8192) < abs(4 * mean_row - 8192)
    packed = bench.packed_micro_batch_tokens(mask, rows)
    assert packed["count"] == 8 and packed["mean"] == pytest.approx(float(mask.sum()) / 8)
    assert packed["max"] == max(int(c.sum()) for c in mask.split(8))


def test_flops_of_a_moe_model_count_active_experts_and_the_router():
    from skyrl_megatron.planner.arch import ModelArch

    bench = _bench_module()
    config = bench.model_config("Qwen3-30B-A3B", layers=2)
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (2, 128, 8)
    arch = ModelArch.from_hf_config(config.to_dict())
    mask = torch.ones(1, 6, dtype=torch.long)
    h, layers, heads, kv, d, expert_ffn, experts, top_k, vocab = 2048, 2, 32, 4, 128, 768, 128, 8, 151936
    per_token = layers * (h * heads * d * 2 + h * kv * d * 2 + top_k * 3 * h * expert_ffn + h * experts) + vocab * h
    expected = 2 * per_token * 6 + 2 * layers * heads * d * 6**2
    assert bench.forward_flops(arch, mask) == pytest.approx(expected, rel=1e-12)


def test_moe_layouts_compose_for_our_workers(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    bench = _bench_module()
    make_tiny_hf_model("qwen3_moe", tmp_path, seed=0)
    settings = _settings(bench, tmp_path)
    mc = bench.compose(bench.Case.parse("megatron:ep2"), settings).trainer.policy.megatron_config
    assert (mc.tensor_model_parallel_size, mc.expert_model_parallel_size) == (1, 2)
    mc = bench.compose(bench.Case.parse("megatron:tp2ep2"), settings).trainer.policy.megatron_config
    assert (mc.tensor_model_parallel_size, mc.expert_model_parallel_size, mc.expert_tensor_parallel_size) == (2, 2, 1)
    assert bench.Case.parse("megatron:tp2ep2").gpus == 2


def test_render_labels_which_fsdp2_is_which(tmp_path):
    bench = _bench_module()
    phase = {"seconds": [1.0], "median_seconds": 1.0, "tokens_per_s_per_gpu": 100.0, "mfu": 0.2, "mfu_datasheet": 0.16,
             "peak_gib": 10.0}
    fsdp_path = {"transformer_engine": False, "sample_packing": True, "logprobs": "flash-attn Triton cross entropy"}
    cases = [
        {"case": "megatron:world1", "backend": "megatron", "layout": "world1", "variant": "", "gpus": 1,
         "path": {"transformer_engine": False, "attention": "ours (SDPA / varlen)", "fused_kernels": ["rope"]},
         "phases": {"forward": {**phase, "tokens_per_s_per_gpu": 300.0}}},
        {"case": "fsdp2:world1", "backend": "fsdp2", "layout": "world1", "variant": "", "gpus": 1,
         "path": {**fsdp_path, "attention": "flash_attention_2", "flash_attn": "stand-in: torch FA2 varlen", "experts": "grouped_mm"},
         "phases": {"forward": {**phase, "tokens_per_s_per_gpu": 200.0}}},
        {"case": "fsdp2_sdpa:world1", "backend": "fsdp2_sdpa", "layout": "world1", "variant": "", "gpus": 1,
         "path": {**fsdp_path, "attention": "sdpa", "sample_packing": False}, "phases": {"forward": phase}},
    ]
    report = {"model": "Qwen3-30B-A3B (8 layers)", "device": "NVIDIA H200", "max_gpus": 1, "date": "2026-11-24", "command": "c",
              "batch": {"rows": 64, "prompt_tokens": 256, "min_response": 64, "max_response": 4096}, "tokens": 1000,
              "peak_tflops": 780.0, "datasheet_tflops": 989.0, "recompute": False, "token_budget": 8192, "fsdp_micro_rows": 2,
              "fsdp_packed_rows": 8, "fsdp_packed_tokens": {"mean": 8646.5, "max": 15000, "count": 8},
              "fsdp_flash_attn": "stand-in (x)", "variants": {}, "steps": 1, "warmup": 1, "cases": cases,
              "composed_only": [], "failed": {}}
    text = bench.markdown_section(report)
    assert "`fsdp2`: the host's FSDP2 at its best: flash_attention_2, sample packing, no activation checkpointing; " \
           "8 rows per micro-batch packed into one sequence (8,646 tokens on average, 15,000 at most); flash_attn: stand-in (x)." in text
    assert "`fsdp2_sdpa`: host defaults without flash-attn: HF SDPA on padded micro-batches, 2 rows each." in text
    assert "| fsdp2:world1 | flash_attention_2, packed (stand-in: torch FA2 varlen), experts: grouped_mm, Triton CE | forward |" in text
    assert "| fsdp2_sdpa:world1 | sdpa, padded, Triton CE | forward | 1.00 | - | 100 | 20.0% | 16.0% | 10.0 |" in text
    assert "(datasheet dense bf16: 989)" in text
    assert "- megatron:world1 vs fsdp2:world1 (FSDP2 at its best): forward 1.50x speed" in text
    assert "- megatron:world1 vs fsdp2_sdpa:world1 (host defaults without flash-attn): forward 3.00x speed" in text
    assert [bench.case_label(report, r) for r in cases] == ["ours world1", "FSDP2 best (FA2 packed) world1",
                                                            "FSDP2 SDPA padded world1"]
    old = {**report, "cases": cases[:2]}
    del old["fsdp_packed_rows"]  # an earlier report: its fsdp2 was the padded SDPA baseline
    assert bench.case_label(old, cases[1]) == "FSDP2 SDPA padded world1"


def test_fsdp2_gets_the_standin_where_flash_attn_has_no_cuda_build(tmp_path, monkeypatch):
    import types

    bench = _bench_module()
    with pytest.raises(SystemExit, match="flash_attn_2_cuda.* is not importable here; use --fsdp-flash-attn standin"):
        bench.flash_attn_for_fsdp2("installed", tmp_path)
    # the host's placeholder for the missing extension does not count as a build
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    site, what = bench.flash_attn_for_fsdp2("auto", tmp_path)
    assert what.startswith("stand-in") and Path(site) == tmp_path / "flash_attn_standin"
    assert (Path(site) / "flash_attn" / "flash_attn_interface.py").is_file()
    assert (Path(site) / "flash_attn-2.8.3.dist-info" / "METADATA").read_text().startswith("Metadata-Version")


def test_the_fsdp2_sides_take_flash_attn_4_where_ours_does(tmp_path, monkeypatch):
    from skyrl_megatron.model.layers import attention

    bench = _bench_module()
    # our kernel choice as on a GPU: flash-attn-4 installed, an sm90 device
    monkeypatch.setattr(attention, "flash4_installed", lambda: True)
    monkeypatch.setattr(attention, "_compute_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a GPU")
    assert bench.baseline_attention_kernel("auto", False, "/standin", host_side=True) == bench.FLASH4
    assert bench.baseline_attention_kernel("flash2", False, "/standin", host_side=True) == "flash2"
    assert bench.baseline_attention_kernel("auto", True, None, host_side=True) == "flash2"  # the CPU smoke run
    # the host's workers on an installed flash-attn 2 build cannot take it: said before any case runs
    with pytest.raises(SystemExit, match="--fsdp-flash-attn standin or --baseline-attention flash2"):
        bench.baseline_attention_kernel("auto", False, None, host_side=True)
    assert bench.baseline_attention_kernel("auto", False, None, host_side=False) == bench.FLASH4  # the loop alone
    monkeypatch.setattr(attention, "_compute_capability", lambda index: (8, 0))  # ours takes varlen there
    assert bench.baseline_attention_kernel("auto", False, "/standin", host_side=True) == "flash2"
    monkeypatch.setattr(attention, "flash4_installed", lambda: False)
    monkeypatch.setattr(attention, "_compute_capability", lambda index: (9, 0))
    assert bench.baseline_attention_kernel("auto", False, "/standin", host_side=True) == "flash2"
    # the host's workers are told through the stand-in's variable
    settings = _settings(bench, tmp_path, flash_attn_site="/standin", baseline_attention=bench.FLASH4)
    monkeypatch.setenv("PYTHONPATH", "")
    assert bench.case_environment(bench.Case.parse("fsdp2:world1"), settings) == {
        "PYTHONPATH": "/standin", bench.STANDIN_KERNEL_VARIABLE: bench.FLASH4}
    assert bench.case_environment(bench.Case.parse("megatron:world1"), settings) == {}


def test_the_plain_loop_sends_packed_attention_to_flash_attn_4_when_asked(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import fsdp2_loop

    class OnGpu(torch.Tensor):  # reports CUDA without a GPU, for the dispatch alone
        @property
        def is_cuda(self):
            return True

    calls = []

    def flash4(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        calls.append((q.shape, cu_seqlens_q.tolist(), max_seqlen_q, softmax_scale, causal))
        return torch.zeros(q.shape).as_subclass(OnGpu), None  # (out, lse), as some releases return

    monkeypatch.setattr(fsdp2_loop, "_flash4_varlen", lambda: flash4)
    monkeypatch.setattr(fsdp2_loop, "_flash_varlen", lambda: pytest.fail("flash-attn 2 called"))
    monkeypatch.setitem(fsdp2_loop._KERNEL, "name", "flash2")
    fsdp2_loop.register_attention("flash4")
    query = torch.randn(1, 4, 7, 8).as_subclass(OnGpu)  # [1, heads, T, dim]
    key = torch.randn(1, 2, 7, 8).as_subclass(OnGpu)
    out, _ = fsdp2_loop.varlen_attention(None, query, key, key, None, scaling=0.5,
                                         cu_seq_lens_q=torch.tensor([0, 3, 7]), max_length_q=4)
    assert out.shape == (1, 7, 4, 8)
    assert calls == [(torch.Size([7, 4, 8]), [0, 3, 7], 4, 0.5, True)]


def test_a_training_phase_peak_counts_the_passes_before_the_optimizer_step():
    """Our workers reset the allocator's peak counter per phase: after a training call the counter holds
    only the optimizer step's peak, their own record the training passes' higher one (the bench's runs of
    2026-11-27 before 13:00 UTC read the counter alone)."""
    from skyrl_megatron.workers.memory_peaks import PhasePeaks

    bench = _bench_module()
    peaks = PhasePeaks()
    peaks._peaks = {"training": {"peak_allocated_gib": 97.0, "peak_reserved_gib": 99.0},
                    "optimizer_step": {"peak_allocated_gib": 67.6, "peak_reserved_gib": 99.0}}
    assert bench.peak_since_last_call(67.6, peaks.drain()) == 97.0
    assert bench.peak_since_last_call(67.6, peaks.drain()) == 67.6  # drained: the next call starts afresh
    assert bench.peak_since_last_call(111.2, {}) == 111.2  # the host's FSDP2 workers record no phases


def test_allocator_calls_are_counted_between_two_readings():
    bench = _bench_module()
    before = {"cuda_mallocs": 10, "cuda_frees": 4, "alloc_retries": 0}
    after = {"cuda_mallocs": 13, "cuda_frees": 9, "alloc_retries": 1}
    assert bench.counts_between(before, after) == {"cuda_mallocs": 3, "cuda_frees": 5, "alloc_retries": 1}
    if not torch.cuda.is_available():
        assert bench.allocator_counts() == dict.fromkeys(bench.ALLOCATOR_COUNTERS, 0)


# ----------------------------------------------------------------------------------------------
# The plain FSDP2 loop (bench/fsdp2_loop.py): host-independent, so it runs here on CPU
# ----------------------------------------------------------------------------------------------


def _loop_scores_and_trains(rank, world, model_dir, batch, prompt_tokens):
    """On one rank: the loop's packed scoring against an unpacked HF forward per row, then three training
    steps on the same batch against the first scoring's logprobs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fsdp2_loop
    from transformers import AutoModelForCausalLM

    settings = fsdp2_loop.LoopSettings(model_dir, token_budget=40, prompt_tokens=prompt_tokens, lr=1e-3)
    loop, scoring, training = fsdp2_loop.build(settings, batch, rank, world)
    rows = fsdp2_loop.host_rows(batch, prompt_tokens)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    packed, unpacked = loop.score(scoring), {}
    with torch.no_grad():
        for i in packed:
            logits = reference(input_ids=rows[i].tokens[None]).logits[0].float()
            start = rows[i].response_start
            unpacked[i] = logits[start - 1:-1].log_softmax(-1).gather(-1, rows[i].tokens[start:, None])[:, 0]
    def weights():  # the root stays unsharded after its forward (reshard_after_forward=False): plain tensors
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in loop.model.named_parameters()}

    before = weights()
    losses = [loop.train(training, packed) for _ in range(3)]
    after = weights()
    changed = sum(not torch.equal(before[name], after[name]) for name in before)
    return {"packed": packed, "unpacked": unpacked, "losses": losses, "changed": changed, "params": len(before),
            "micro_batches": (len(scoring), len(training)), "rows_per_micro_batch": [len(mb.rows) for mb in training]}


def test_plain_fsdp2_loop_scores_like_unpacked_hf_and_its_steps_lower_the_loss(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model
    from skyrl_megatron.testing.distributed import run_on_ranks

    bench = _bench_module()
    model_dir = make_tiny_hf_model("qwen3", tmp_path, seed=0)
    shape = bench.BatchShape(rows=8, prompt_tokens=8, min_response=2, max_response=16, samples_per_prompt=2)
    batch = bench.rl_batch(shape, vocab_size=json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"],
                           pad_token_id=0)
    (result,) = run_on_ranks(_loop_scores_and_trains, 1, str(model_dir), batch, shape.prompt_tokens, timeout=300)
    # every row scored once, packed several to a sequence, and equal to its own unpadded forward
    assert sorted(result["packed"]) == list(range(shape.rows))
    assert max(result["rows_per_micro_batch"]) > 1 and result["micro_batches"][1] > result["micro_batches"][0]
    for row, logprobs in result["packed"].items():
        assert logprobs.shape == (int(batch["loss_mask"][row].sum()),)
        torch.testing.assert_close(logprobs, result["unpacked"][row], rtol=0, atol=2e-5)
    # the optimizer moves every weight, and the policy loss falls on the repeated batch
    assert result["changed"] == result["params"]
    losses = result["losses"]
    assert losses[0] > losses[1] > losses[2], losses


def test_ratios_name_their_fsdp2_side_and_the_loop_is_labelled(tmp_path):
    bench = _bench_module()

    def case(backend, speed):
        phase = {"seconds": [1.0], "median_seconds": 1.0, "median_worker_seconds": 1.0, "tokens_per_s_per_gpu": speed,
                 "mfu": 0.2, "mfu_datasheet": 0.1, "peak_gib": 10.0}
        path = {"transformer_engine": False, "attention": "varlen (transformers attention interface)",
                "sample_packing": True, "flash_attn": "stand-in: torch FA2 varlen",
                "logprobs": "flash-attn Triton cross entropy"}
        return {"case": f"{backend}:world1", "backend": backend, "layout": "world1", "variant": "", "gpus": 1,
                "path": path, "phases": {"train": phase}}

    cases = [case("megatron", 300.0), case("fsdp2", 100.0), case("fsdp2_loop", 150.0)]
    report = {"model": "m", "device": "NVIDIA H200", "max_gpus": 1, "date": "2026-11-28", "command": "c",
              "batch": {"rows": 64, "prompt_tokens": 256, "min_response": 64, "max_response": 4096}, "tokens": 1000,
              "peak_tflops": 780.0, "recompute": False, "token_budget": 8192, "fsdp_micro_rows": 2,
              "fsdp_packed_rows": 8, "fsdp_packed_tokens": {"mean": 8000.0, "max": 9000, "count": 8}, "variants": {},
              "steps": 1, "warmup": 1, "cases": cases, "composed_only": [], "failed": {}}
    text = bench.markdown_section(report)
    assert "- megatron:world1 vs fsdp2:world1 (FSDP2 at its best): train 3.00x speed" in text
    assert "- megatron:world1 vs fsdp2_loop:world1 (plain FSDP2 loop): train 2.00x speed" in text
    assert "- fsdp2_loop:world1 vs fsdp2:world1 (FSDP2 at its best): train 1.50x speed" in text
    assert "`fsdp2_loop`: plain FSDP2 loop (bench/fsdp2_loop.py)" in text and "8192 tokens in training, 32768 in scoring" in text
    assert bench.case_label(report, cases[2]) == "plain FSDP2 loop world1"


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _measured_worker(bench, clock: _FakeClock):
    """`_Measured` over a worker whose calls take a known time on `clock`: skyrl 0.4's training calls
    (`forward_backward`, `optim_step`) and a 0.3.1-style `ppo_train` that runs its own `forward_backward`."""

    class Worker:
        def forward(self, data):
            clock.now += 1.0
            return "scored"

        def forward_backward(self, data):
            clock.now += 2.0
            return {"policy_loss": 0.5}

        def optim_step(self):
            clock.now += 0.5
            return 1.0

        def ppo_train(self, data):
            clock.now += 0.25
            self.forward_backward(data)
            self.optim_step()
            return "trained"

        def empty_cache(self):
            clock.now += 0.125

    return type("MeasuredWorker", (bench._Measured, Worker), {})()


def test_a_phase_adds_up_its_calls_from_its_beginning_and_counts_a_nested_call_once(monkeypatch):
    """skyrl 0.4 trains a step as forward_backward + optim_step per mini-batch, 0.3.1 as one ppo_train (whose
    host FSDP2 version calls its own forward_backward): the bench's training time is the sum of a step's calls,
    with a call inside a timed call counted once."""
    bench = _bench_module()
    clock = _FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    worker = _measured_worker(bench, clock)

    worker.bench_begin("forward")
    assert worker.forward(None) == "scored"
    worker.empty_cache()  # the host's request after the call: its own key, not the phase's seconds
    worker.bench_begin("train")
    for _ in range(2):  # two mini-batches
        worker.forward_backward(None)
        worker.optim_step()
    worker.empty_cache()
    worker.empty_cache()
    assert worker.bench_worker_seconds() == {"forward": 1.0, "forward:empty_cache": 0.125,
                                             "train": 5.0, "train:empty_cache": 0.25}

    worker.bench_begin("train")  # the next step starts from zero
    assert worker.ppo_train(None) == "trained"
    assert worker.bench_worker_seconds()["train"] == 2.75  # not 2.75 + 2.5 for the calls inside it
    assert worker.bench_allocator_calls()["train"] == {"cuda_mallocs": 0, "cuda_frees": 0, "alloc_retries": 0}


def test_the_fsdp2_side_is_the_installed_hosts_worker():
    from skyrl_megatron import host_api
    from skyrl_megatron.activation import activate

    activate()  # the host's compat fixes: its FSDP worker module imports flash_attn's padding helpers
    base = _bench_module().host_fsdp_policy_base()
    assert base.__name__ == "FSDPPolicyWorkerBase"
    assert base.__module__ == host_api.strategy_worker_modules["fsdp2"]


def _loop_profiled(rank, world, model_dir, batch, prompt_tokens, phase, out_file):
    sys.path.insert(0, str(ROOT / "bench"))
    import fsdp2_loop

    settings = fsdp2_loop.LoopSettings(model_dir, token_budget=40, prompt_tokens=prompt_tokens, steps=1,
                                       profile_phase=phase, profile_heading=f"{phase}, rank 0", profile_file=out_file)
    measured = fsdp2_loop.measure(rank, world, settings, batch)
    return measured.profile, len(measured.losses)


@pytest.mark.parametrize("phase", ["forward", "train"])
def test_the_plain_loop_profiles_one_more_step_of_the_phase_asked(tmp_path, phase):
    """Both sides of a ratio get a profile (`--profile`): the loop's, like our workers', is one extra step after
    the measured ones, rank 0's report with where the device waited and the top operators."""
    from skyrl_megatron.testing import make_tiny_hf_model
    from skyrl_megatron.testing.distributed import run_on_ranks

    bench = _bench_module()
    model_dir = make_tiny_hf_model("qwen3", tmp_path / "model", seed=0)
    shape = bench.BatchShape(rows=4, prompt_tokens=8, min_response=2, max_response=16, samples_per_prompt=2)
    batch = bench.rl_batch(shape, vocab_size=json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"],
                           pad_token_id=0)
    report = tmp_path / "profile_fsdp2_loop.txt"
    summaries = run_on_ranks(_loop_profiled, 2, str(model_dir), batch, shape.prompt_tokens, phase, str(report),
                             timeout=300)
    for summary, measured_steps in summaries:
        assert measured_steps == 1  # the profiled step is not one of the measured ones
        assert summary["wall_seconds"] > 0 and summary["host_ops"] > 0
    text = report.read_text()
    assert text.startswith(f"{phase}, rank 0: {{") and "top operators by host time" in text
    # the gradients' reduction and the optimizer step appear only in a profiled training call
    assert ("FSDP::post_backward_reduce" in text) == ("Optimizer.step" in text) == (phase == "train")


def test_the_checkpoint_is_converted_in_a_start_up_of_its_own_before_any_of_our_cases_is_timed(tmp_path, monkeypatch):
    """Where ours runs in several cases, the first of them would convert the checkpoint and store the cache entry in
    its own start-up, then be timed in that process while the others load the entry: `--convert-first` (the
    default) converts before any case, so each of ours starts from the cache alike. One case of ours converts as a
    user's first run does."""
    import argparse

    bench = _bench_module()
    variants = {"x": ["trainer.policy.megatron_config.empty_cuda_cache=false"]}
    cases = [bench.Case.parse(text, variants) for text in ("fsdp2_loop:world1", "megatron:world1@x", "megatron:world1")]
    events = []
    monkeypatch.setattr(bench, "convert_once", lambda case, s, tokenizer: events.append(("convert", case.name)) or 1.5)
    monkeypatch.setattr(bench, "run_case", lambda case, *rest: events.append(("run", case.name)) or {"case": case.name})
    monkeypatch.setattr(bench, "run_loop_case", lambda case, *rest: events.append(("run", case.name)) or {"case": case.name})
    settings = bench.Settings(str(tmp_path), bench.BatchShape(), str(tmp_path), cpu=False, token_budget=4096,
                              fsdp_micro_rows=2, recompute=False, steps=1, warmup=1, variants=variants)

    def run(cases, convert_first):
        events.clear()
        report = {"cases": [], "composed_only": [], "failed": {}}
        args = argparse.Namespace(convert_first=convert_first, smoke=False, out=tmp_path / "report.json")
        bench.run_cases(cases, settings, None, None, None, None, report, args)
        return report

    report = run(cases, convert_first=True)
    assert events == [("convert", "megatron:world1@x"), ("run", "fsdp2_loop:world1"), ("run", "megatron:world1@x"),
                      ("run", "megatron:world1")]
    assert report["converted_first_seconds"] == 1.5 and len(report["cases"]) == 3
    assert "converted_first_seconds" not in run(cases, convert_first=False) and events[0] == ("run", "fsdp2_loop:world1")
    run(cases[:2], convert_first=True)  # one case of ours: it converts in its own start-up
    assert [kind for kind, _ in events] == ["run", "run"]
