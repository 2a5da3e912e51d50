"""The memory planner: parameter counts against real checkpoints and published totals, the sharding
properties of the estimate, layout suggestions, and the `skyrl-megatron plan` command."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_megatron.planner import (
    BatchPlan,
    Layout,
    ModelArch,
    PlanError,
    TrainingSetup,
    candidate_layouts,
    estimate,
    layer_activation_bytes,
    layout_problems,
    load_model_arch,
    stage_parameters,
    suggest_layouts,
)
from skyrl_megatron.compute.microbatch.plan import plan_micro_batches
from skyrl_megatron.planner.cli import estimate_from_argv
from skyrl_megatron.planner.cli import main as plan_main
from skyrl_megatron.planner.memory import ADAM_STATE_BYTES, GIB, micro_batches_in_flight

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench's layouts and the examples' planner flags (bench/*.py)
from example_layouts import planner_layout_args  # noqa: E402
from policy_bench import LAYOUTS as BENCH_LAYOUTS  # noqa: E402
from policy_bench import BatchShape, rl_batch  # noqa: E402

MODEL_CONFIGS = ROOT / "examples" / "megatron" / "model_configs"
CLI = shutil.which("skyrl-megatron", path=str(Path(sys.executable).parent)) or "skyrl-megatron"
BATCH = BatchPlan(micro_batch_tokens=8192)


def arch(name: str) -> ModelArch:
    return load_model_arch(MODEL_CONFIGS / f"{name}.json")


# ----------------------------------------------------------------------------------------------
# Parameter counts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("qwen2", {}),
        ("qwen3_moe", {}),
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [0]}),  # dense and MoE layers mixed
    ],
)
def test_parameter_counts_equal_the_hf_model_built_from_the_same_config(tmp_path, family, overrides):
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.testing import make_tiny_hf_model

    checkpoint = make_tiny_hf_model(family, tmp_path / family, **overrides)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    planned = load_model_arch(checkpoint)
    assert planned.num_parameters() == sum(p.numel() for p in model.parameters())
    # Active: everything but the experts a token is not routed to (k of E per MoE layer).
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    share = planned.experts_per_token / planned.num_experts if planned.is_moe else 1.0
    assert planned.num_active_parameters() == round(planned.num_parameters() - experts * (1 - share))
    assert planned.is_moe == (experts > 0)


# Published model-card totals, rounded to two or three significant digits: 3% covers the rounding.
@pytest.mark.parametrize(
    "name, total, active",
    [
        ("Qwen3-0.6B", 0.6e9, None),
        ("Qwen3-1.7B", 1.7e9, None),
        ("Qwen3-4B", 4.0e9, None),
        ("Qwen3-30B-A3B", 30.5e9, 3.3e9),
        ("Qwen3-235B-A22B", 235e9, 22e9),
    ],
)
def test_parameter_counts_match_the_published_totals(name, total, active):
    model = arch(name)
    assert model.num_parameters() == pytest.approx(total, rel=0.03)
    if active is not None:
        assert model.num_active_parameters() == pytest.approx(active, rel=0.03)


def test_unknown_model_types_and_missing_files_name_the_model_flag(tmp_path):
    with pytest.raises(PlanError, match="model_type 'gpt2' is not supported") as err:
        ModelArch.from_hf_config({"model_type": "gpt2"})
    assert err.value.flag == "--model"
    with pytest.raises(PlanError, match="neither a config.json nor a directory") as err:
        load_model_arch(tmp_path / "missing")
    assert err.value.flag == "--model"


# ----------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------


def test_doubling_tp_halves_the_sharded_parameters_and_keeps_the_norms():
    model = arch("Qwen3-1.7B")
    one, two = (stage_parameters(model, Layout(gpus_per_node=8, tp=tp), 0) for tp in (1, 2))
    assert two.tp_sharded * 2 == one.tp_sharded
    # Replicated on every TP rank: two RMSNorms and the q/k norms per layer, plus the final norm.
    h, d = model.hidden_size, model.head_dim
    assert one.replicated == two.replicated == model.num_layers * (2 * h + 2 * d) + h
    assert estimate(model, Layout(gpus_per_node=8, tp=2), BATCH).params == 2 * two.total


def test_pipeline_stages_hold_every_parameter_once_plus_the_tied_embedding_copy():
    for name, layout in (("Qwen3-1.7B", Layout(gpus_per_node=4, pp=4)), ("Qwen3-30B-A3B", Layout(gpus_per_node=8, pp=4, ep=2))):
        model = arch(name)
        stages = [stage_parameters(model, layout, s) for s in range(layout.pp)]
        on_all_gpus = sum(s.tp_sharded + s.replicated + s.expert * layout.ep for s in stages)
        tied_copy = model.embedding_params if model.tie_word_embeddings else 0
        assert on_all_gpus == model.num_parameters() + tied_copy
        # the embedding lives on the first stage and the output layer on the last
        assert stages[0].tp_sharded - stages[1].tp_sharded == model.embedding_params


def test_data_parallelism_shards_only_the_optimizer_state():
    model, fp32_masters = arch("Qwen3-1.7B"), TrainingSetup(compact_master_weights=False)
    single, eight = (estimate(model, Layout(gpus_per_node=n), BATCH, fp32_masters) for n in (1, 8))
    assert (eight.params, eight.grads, eight.activations) == (single.params, single.grads, single.activations)
    assert eight.optimizer * 8 == pytest.approx(single.optimizer, rel=1e-9)
    unsharded = estimate(model, Layout(gpus_per_node=8), BATCH, TrainingSetup(distributed_optimizer=False))
    assert unsharded.optimizer == single.optimizer


def test_expert_state_is_sharded_over_the_expert_data_parallel_group():
    model = arch("Qwen3-30B-A3B")
    for nodes, expert_dp in ((1, 1), (4, 4)):
        layout = Layout(nodes=nodes, gpus_per_node=8, ep=8, etp=1)
        assert layout.expert_dp == expert_dp
        params = stage_parameters(model, layout, 0)
        assert params.expert * 8 == sum(model.layer_params(i).expert for i in range(model.num_layers))
        dense = params.tp_sharded + params.replicated
        expected = ADAM_STATE_BYTES * (dense / layout.dp + params.expert / expert_dp)
        assert estimate(model, layout, BATCH, TrainingSetup(compact_master_weights=False)).optimizer == round(expected)


def test_recompute_orders_activations_full_below_selective_below_none():
    for name, layout in (("Qwen3-1.7B", Layout(gpus_per_node=8, tp=2)), ("Qwen3-30B-A3B", Layout(gpus_per_node=8, ep=8))):
        model = arch(name)
        none, selective, more_selective, full = (
            estimate(model, layout, BatchPlan(8192, recompute=r, recompute_modules=m)).activations
            for r, m in (("none", ()), ("selective", ("core_attn",)), ("selective", ("core_attn", "layernorm", "mlp", "moe_act")), ("full", ()))
        )
        assert full < more_selective < selective < none
        # full recompute keeps one bf16 hidden state per token and layer (sequence-parallel split)
        per_token = model.hidden_size * 2 / layout.tp
        assert full == round(model.num_layers * 8192 * per_token)


def test_fused_swiglu_saves_one_ffn_wide_tensor_per_layer():
    model, layout = arch("Qwen3-1.7B"), Layout(gpus_per_node=8, tp=2)
    unfused, fused = (estimate(model, layout, BatchPlan(8192, swiglu_fusion=f)).activations for f in (False, True))
    assert unfused - fused == model.num_layers * 8192 * (model.ffn_hidden_size // 2) * 2  # bf16, TP-split


def test_the_training_side_gated_gemms_keep_one_ffn_wide_tensor_less_per_dense_layer():
    model, layout = arch("Qwen3-1.7B"), Layout(gpus_per_node=8, tp=2)
    default, gated = (estimate(model, layout, BatchPlan(8192, swiglu_gemm_training=g)).activations for g in (False, True))
    assert default - gated == model.num_layers * 8192 * (model.ffn_hidden_size // 2) * 2  # bf16, TP-split
    moe = arch("Qwen3-30B-A3B")  # the experts keep Megatron's path
    assert (estimate(moe, Layout(gpus_per_node=8, ep=8), BatchPlan(8192, swiglu_gemm_training=True)).activations
            == estimate(moe, Layout(gpus_per_node=8, ep=8), BatchPlan(8192)).activations)


def test_sequence_and_context_parallelism_shrink_activations():
    model = arch("Qwen3-1.7B")
    with_sp, without_sp = (
        layer_activation_bytes(model, Layout(gpus_per_node=8, tp=2, sequence_parallel=sp), BATCH, moe_layer=False) for sp in (True, False)
    )
    assert with_sp < without_sp
    cp1, cp2 = (layer_activation_bytes(model, Layout(gpus_per_node=8, cp=cp), BATCH, moe_layer=False) for cp in (1, 2))
    assert cp1 / 2 < cp2 < cp1  # each CP rank keeps half the tokens, but all-gathered keys and values


def test_pipeline_keeps_pp_micro_batches_on_the_first_stage_and_interleaving_adds_the_known_factor():
    assert [micro_batches_in_flight(Layout(gpus_per_node=4, pp=4), s) for s in range(4)] == [4, 3, 2, 1]
    pp, vpp = 4, 2
    interleaved = micro_batches_in_flight(Layout(gpus_per_node=4, pp=pp, vpp=vpp), 0)
    assert interleaved == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))  # Korthikanti et al. 2022


def test_the_most_loaded_stage_is_reported():
    result = estimate(arch("Qwen3-1.7B"), Layout(gpus_per_node=4, pp=4), BATCH)
    assert len(result.stage_totals) == 4
    assert result.total == max(result.stage_totals) == result.stage_totals[result.stage]
    assert result.stage == 0  # four micro-batches in flight plus the embedding


def test_lora_trains_only_adapters_and_offload_moves_optimizer_state_off_the_gpu():
    model, layout = arch("Qwen3-30B-A3B"), Layout(gpus_per_node=8, ep=8)
    full = estimate(model, layout, BATCH, TrainingSetup(compact_master_weights=False))  # as offloading settles auto
    lora = estimate(model, layout, BATCH, TrainingSetup(lora_rank=32))
    assert lora.params > full.params  # the frozen base stays, adapters are added
    assert lora.grads < full.grads / 10 and lora.optimizer < full.optimizer / 10
    assert estimate(model, layout, BATCH, TrainingSetup(optimizer_offload_fraction=1.0)).optimizer == 0
    half = estimate(model, layout, BATCH, TrainingSetup(optimizer_offload_fraction=0.5)).optimizer
    assert half == pytest.approx(full.optimizer / 2, abs=1)


def test_the_optimizer_step_holds_an_fp32_copy_of_the_gpu_shard_per_temporary_and_counts_only_when_larger():
    """Fused Adam with fp32 gradients allocates nothing shard-sized; foreach AdamW's sqrt(v) and the fp32
    copies of bf16 gradients are one fp32 shard each; the step sets the peak only where it outgrows backward."""
    model, layout, recomputed = arch("Qwen3-30B-A3B"), Layout(gpus_per_node=8, ep=8), BatchPlan(8192, recompute="full")
    fp32_masters = {"compact_master_weights": False}  # (compact masters add their own term: the test below)
    fused = estimate(model, layout, recomputed, TrainingSetup(**fp32_masters))
    assert fused.optimizer_step == 0
    assert fused.total == fused.params + fused.grads + fused.optimizer + fused.activations + fused.transient + fused.overhead
    foreach = estimate(model, layout, recomputed, TrainingSetup(fused_adam=False, **fp32_masters))
    shard = foreach.optimizer / 3  # Adam's three fp32 tensors per element of the GPU shard
    assert foreach.optimizer_step == pytest.approx(shard, abs=1)
    assert foreach.optimizer_step > foreach.activations + foreach.transient
    assert foreach.total == foreach.params + foreach.grads + foreach.optimizer + foreach.optimizer_step + foreach.overhead
    bf16_grads = estimate(model, layout, recomputed, TrainingSetup(fused_adam=False, grad_reduce_in_fp32=False, **fp32_masters))
    assert bf16_grads.optimizer_step == pytest.approx(2 * shard, abs=2)
    offloaded = estimate(model, layout, recomputed, TrainingSetup(fused_adam=False, optimizer_offload_fraction=1.0))
    assert offloaded.optimizer_step == 0  # the CPU share steps on the CPU
    assert offloaded.total == offloaded.params + offloaded.grads + offloaded.activations + offloaded.transient + offloaded.overhead
    no_recompute = estimate(arch("Qwen3-1.7B"), Layout(gpus_per_node=8, tp=1), BatchPlan(micro_batch_tokens=16384),
                            TrainingSetup(fused_adam=False, **fp32_masters))
    assert no_recompute.optimizer_step < no_recompute.activations + no_recompute.transient


def test_compact_master_weights_keep_2_bytes_of_each_master_between_steps_and_rebuild_them_in_the_step():
    model, layout = arch("Qwen3-4B"), Layout(gpus_per_node=2)
    fp32, compact = (estimate(model, layout, BATCH, TrainingSetup(compact_master_weights=on, compact_adam=False))
                     for on in (False, True))
    shard = fp32.optimizer / ADAM_STATE_BYTES
    assert fp32.optimizer - compact.optimizer == pytest.approx(2 * shard, abs=2)  # int16 remainder for fp32 master
    assert compact.optimizer_step - fp32.optimizer_step == pytest.approx(2 * shard, abs=2)  # the step's fp32 masters
    assert compact.total == pytest.approx(fp32.total - 2 * shard, abs=2)  # backward, not the step, sets this peak
    auto = estimate(model, layout, BATCH, TrainingSetup(compact_adam=False))  # the default: compact where it can be
    assert auto.optimizer == compact.optimizer and auto.optimizer_step == compact.optimizer_step
    for unsharded in (TrainingSetup(distributed_optimizer=False), TrainingSetup(optimizer_offload_fraction=0.5)):
        assert not unsharded.compacts_masters  # auto settles on fp32 masters there, with no error
        estimate(model, layout, BATCH, unsharded)
    refused = ((TrainingSetup(compact_master_weights=True, distributed_optimizer=False), "--no-distributed-optimizer"),
               (TrainingSetup(compact_master_weights=True, optimizer_offload_fraction=0.5), "--optimizer-offload-fraction"))
    for setup, named in refused:
        with pytest.raises(PlanError) as raised:
            estimate(model, layout, BATCH, setup)
        assert raised.value.flag == "--compact-master-weights" and named in raised.value.fix


def test_compact_adam_steps_the_compact_masters_without_rebuilding_them():
    """compact_adam (auto: where the masters are compact and the gradients fp32, as the workers settle it) steps
    each run of compact masters in one pass: the step holds no fp32 masters and runs no torch AdamW, only the runs'
    tie bits (1/8 byte an element of the shard) until its one host read."""
    model, layout = arch("Qwen3-4B"), Layout(gpus_per_node=2)
    rebuilt, in_place = (estimate(model, layout, BATCH, TrainingSetup(compact_adam=on)) for on in (False, "auto"))
    shard = rebuilt.optimizer / (ADAM_STATE_BYTES - 2)  # compact masters between steps: 10 B an element
    assert in_place.optimizer_step == pytest.approx(shard / 8, abs=1)
    assert in_place.optimizer_step < rebuilt.optimizer_step
    assert in_place.optimizer == rebuilt.optimizer and in_place.activations == rebuilt.activations
    for off in (TrainingSetup(grad_reduce_in_fp32=False), TrainingSetup(compact_master_weights=False),
                TrainingSetup(distributed_optimizer=False)):
        assert not off.steps_compact_masters_in_place  # auto settles off there, with no error
        explicit = dataclasses.replace(off, compact_adam=False)
        assert estimate(model, layout, BATCH, off) == estimate(model, layout, BATCH, explicit)
    for setup, fix in ((TrainingSetup(compact_adam=True, grad_reduce_in_fp32=False), "fp32 gradient buffers"),
                       (TrainingSetup(compact_adam=True, compact_master_weights=False), "compact master weights")):
        with pytest.raises(PlanError) as raised:
            estimate(model, layout, BATCH, setup)
        assert raised.value.flag == "--compact-adam" and fix in raised.value.fix
    assert estimate_from_argv(["--model", str(MODEL_CONFIGS / "Qwen3-4B.json"), "--compact-adam", "false"]).optimizer_step > 0


# the scaled example runs (a results directory each), with the planner flags matching the code they ran: the
# 2026-11-26 runs (2 x H200) had torch's foreach AdamW (fused Adam came later), 256 MiB logits chunks (the default
# then), fp32 masters (compact ones became the default later), the eager logprob chain and the head's weight
# gradient in a buffer of its own; the 2026-12-07 run (one H100) had today's defaults, compact adam included
_NOVEMBER_EXAMPLE_CODE = (["--logits-chunk-mib", "256", "--unfused-logprobs", "--no-gradient-accumulation-fusion"],
                          {"fused_adam": False, "compact_master_weights": False})
SCALED_EXAMPLE_FLAGS = {
    "2026-11-26_examples_4nodes_1.7b": _NOVEMBER_EXAMPLE_CODE,
    "2026-11-26_examples_moe": _NOVEMBER_EXAMPLE_CODE,
    "2026-12-07_examples_compact_adam": ([], {}),
}
SCALED_EXAMPLE_RUNS = sorted((ROOT / "docs" / "results").glob("*_examples_*/run_qwen3_*"))


def test_every_scaled_example_run_is_planned_with_its_code():
    assert {d.parent.name for d in SCALED_EXAMPLE_RUNS} == set(SCALED_EXAMPLE_FLAGS)


@pytest.mark.parametrize("directory", SCALED_EXAMPLE_RUNS, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_plan_bounds_the_policy_peak_measured_on_gpus_within_ten_percent(directory):
    """The example layouts, scaled to a few layers, ran 2 GRPO steps (bench/gpu_examples.py): the plan without its
    fixed overhead (which covers what the allocator does not count) is at least the policy's peak allocated memory
    in every phase, and at most 10% above it, planned with the settings of the code each run had."""
    results = json.loads((directory.parent / "results.json").read_text())
    planner_args = {r["script"]: r["planner_args"] for r in results}
    flags, setup = SCALED_EXAMPLE_FLAGS[directory.parent.name]
    argv = ["--model", str(directory / "scaled_config.json"), *planner_args[f"{directory.name}.sh"], *flags]
    planned = estimate_from_argv(argv, **setup)
    steps = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    measured = max(v for step in steps for k, v in step.items() if k.startswith("memory/policy_") and "allocated" in k) * GIB
    assert len(steps) == 2 and all(step["sync/bitwise_equal"] == 1.0 for step in steps)
    assert measured <= planned.total - planned.overhead <= 1.10 * measured


# the runs (a results directory each), with what the code they ran defaulted to: the logprob head's chunk (MiB;
# 256 in the first, 1024 from the second on), whether master weights were compact without a variant saying so
# (`auto` from the third on), whether token-budget plans spread their rows evenly (from 2026-11-28 on: the largest
# micro-batch then falls short of the budget, and the plan is made for the largest one that ran; before, first-fit
# filled them to the budget), the logits a training forward kept for its backward (MiB; from 2026-12-02 on), and
# whether the head's output weight gradient went straight into main_grad (from 2026-12-02 on; before, the head
# accumulated it in an fp32 buffer of its own, as it does today without gradient_accumulation_fusion), and whether
# compact adam was the default (from 2026-12-07 on: `auto`)
BENCH_RUN_DEFAULTS = {"2026-11-27_true_peaks": ("256", False, False, "0", False, False),
                      "2026-11-27_new_defaults": ("1024", False, False, "0", False, False),
                      "2026-11-27_two_gpu_rows": ("1024", True, False, "0", False, False),
                      "2026-11-28_spread_plans": ("1024", True, True, "0", False, False),
                      "2026-12-06_three_sides_library_norm": ("1024", True, True, "4096", True, False),
                      "2026-12-07_compact_adam": ("1024", True, True, "4096", True, False),
                      "2026-12-07_swiglu_gemm_end_to_end": ("1024", True, True, "4096", True, True)}
# Not here: the runs with the Triton kernels (docs/results/2026-11-28_triton_kernels/) and the others between
# 2026-11-28 and 2026-12-02, whose code read query and key in place but still accumulated the head's weight gradient
# apart and kept no logits.
POLICY_BENCH_RUNS = [p for run in BENCH_RUN_DEFAULTS for p in sorted((ROOT / "docs" / "results" / run).glob("*.json"))
                     if any(c["backend"] == "megatron" for c in json.loads(p.read_text()).get("cases", []))]


def _bench_layout_args(layout: str) -> tuple[int, list[str]]:
    """(GPUs, planner flags) of a bench/policy_bench.py layout, read from the overrides the bench gives it."""
    gpus, overrides = BENCH_LAYOUTS[layout]
    prefix = "trainer.policy.megatron_config."
    settings = dict(o[len(prefix):].split("=", 1) for o in overrides if o.startswith(prefix))
    return gpus, planner_layout_args(settings.get, gpus)


def _largest_micro_batch(batch_shape: dict, budget: int) -> int:
    """Tokens in the largest training micro-batch of policy_bench's batch under today's plan."""
    lengths = rl_batch(BatchShape(**batch_shape), vocab_size=1000, pad_token_id=0)["attention_mask"].sum(-1)
    return max(int(lengths[rows].sum()) for rows in plan_micro_batches(lengths, max_tokens=budget).groups)


def _bench_training_peaks(path: Path, tmp_path: Path) -> list[tuple[str, int, list[str], float]]:
    """(case, GPUs, planner argv, measured training peak GiB) of each of our cases in a policy_bench report."""
    report = json.loads(path.read_text())
    name, _, layers = report["model"].partition(" (")
    config = MODEL_CONFIGS / f"{name}.json"
    if layers:  # "Qwen3-30B-A3B (8 layers)": the bench kept the first N layers
        shape = json.loads(config.read_text())
        shape["num_hidden_layers"] = report["layers"]
        config = tmp_path / f"{path.stem}.json"
        config.write_text(json.dumps(shape))
    default_chunk, compact_by_default, spread, kept, head_into_main_grad, adam_by_default = BENCH_RUN_DEFAULTS[path.parent.name]
    peaks = []
    for case in report["cases"]:
        if case["backend"] != "megatron":
            continue
        overrides = report["variants"].get(case["variant"], []) if case["variant"] else []
        chunk = next((o.split("=")[1] for o in overrides if "logits_chunk_mib=" in o), default_chunk)
        budget = int(next((o.split("=")[1] for o in overrides if ".max_tokens_per_microbatch=" in o), report["token_budget"]))
        gpus, layout_flags = _bench_layout_args(case["layout"])
        if spread:
            assert gpus == 1, "the largest micro-batch is recomputed for one rank's rows only"
            budget = _largest_micro_batch(report["batch"], budget)
        argv = ["--model", str(config), *layout_flags, "--gpu-memory-gib", "141",
                "--micro-batch-tokens", str(budget), "--logits-chunk-mib", chunk, "--logits-kept-mib", kept]
        compact = compact_by_default or any(o.endswith("compact_master_weights=true") for o in overrides)
        argv += ["--compact-master-weights", "true" if compact else "false"]
        # before it became the default, compact adam was on only where a variant turned it on
        adam = adam_by_default or any(o.endswith("compact_adam=true") for o in overrides)
        argv += ["--compact-adam", "true" if adam else "false"]
        if any("swiglu_gemm_training" in o for o in overrides):
            argv += ["--swiglu-gemm-training"]
        if not head_into_main_grad:  # the head then: three chunk buffers and its own weight-gradient accumulator
            argv += ["--unfused-logprobs", "--no-gradient-accumulation-fusion"]
        peaks.append((case["case"], gpus, argv, case["phases"]["train"]["peak_gib"]))
    return peaks


@pytest.mark.parametrize("path", POLICY_BENCH_RUNS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_plan_bounds_the_training_peak_of_the_policy_bench_within_ten_percent(path, tmp_path):
    """bench/policy_bench.py on H200s (from 2026-11-27: the first runs whose training peak includes the passes,
    fused Adam): on one GPU the plan, overhead included, is at least the training phase's peak allocated memory
    and at most 10% above it; on two GPUs (DP2, TP2, EP2, TP2 x EP2) the plan without its fixed
    overhead is, as for the example runs above: their peaks are smaller, and the overhead covers NCCL's buffers,
    which the allocator does not count (the logits chunks of the code that ran; compact master weights where
    that code or the case's variant made them; the token budget of the case, or from 2026-11-28 on the largest
    micro-batch that ran)."""
    peaks = _bench_training_peaks(path, tmp_path)
    assert peaks
    for case, gpus, argv, measured_gib in peaks:
        planned = estimate_from_argv(argv)
        bound = (planned.total if gpus == 1 else planned.total - planned.overhead) / GIB
        assert measured_gib <= bound <= 1.10 * measured_gib, (case, measured_gib, bound)


def test_every_example_layout_ran_on_gpus():
    ran = {d.name for d in SCALED_EXAMPLE_RUNS}
    assert ran == {s.stem for s in (ROOT / "examples" / "megatron").glob("run_qwen3_*.sh")}


# ----------------------------------------------------------------------------------------------
# Layout validity and suggestions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, layout, flag, text",
    [
        ("Qwen3-1.7B", Layout(gpus_per_node=3, tp=3), "--tp", "number of attention heads (16) is not divisible by TP=3"),
        ("Qwen3-1.7B", Layout(gpus_per_node=3, pp=3), "--pp/--vpp", "28 layers do not split evenly"),
        ("Qwen3-1.7B", Layout(gpus_per_node=8, ep=2), "--ep/--etp", "is a dense model"),
        ("Qwen3-1.7B", Layout(gpus_per_node=8, vpp=2), "--vpp", "need pipeline parallelism"),
        ("Qwen3-1.7B", Layout(gpus_per_node=6, tp=4), "--tp/--pp/--cp", "world size 6"),
        ("Qwen3-30B-A3B", Layout(gpus_per_node=3, ep=3), "--ep", "number of experts (128) is not divisible by EP=3"),
        ("Qwen3-30B-A3B", Layout(gpus_per_node=8, tp=8), "--tp", "key/value heads (4)"),
        ("Qwen3-30B-A3B", Layout(gpus_per_node=8, tp=2, ep=4, sequence_parallel=False), "--no-sequence-parallel", "sequence parallelism"),
    ],
)
def test_invalid_layouts_name_the_flag(name, layout, flag, text):
    problems = layout_problems(arch(name), layout)
    assert any(p.flag == flag and text in p.message for p in problems), problems
    with pytest.raises(PlanError):
        estimate(arch(name), layout, BATCH)


@pytest.mark.parametrize("name, nodes, gpu_gib", [("Qwen3-1.7B", 1, 24), ("Qwen3-30B-A3B", 1, 141), ("Qwen3-30B-A3B", 4, 80)])
def test_suggestions_are_exactly_the_valid_layouts_that_fit_best_first(name, nodes, gpu_gib):
    model, gpu_bytes = arch(name), gpu_gib * GIB
    batch = BatchPlan(8192, recompute="full")
    suggestions = suggest_layouts(model, nodes, 8, batch, gpu_bytes)
    assert suggestions
    for suggestion in suggestions:
        assert layout_problems(model, suggestion.layout) == []
        assert suggestion.estimate.fits(gpu_bytes)
    suggested = {s.layout for s in suggestions}
    for layout in candidate_layouts(model, nodes, 8):
        if layout not in suggested:
            assert not estimate(model, layout, batch).fits(gpu_bytes)
    sizes = [s.layout.model_parallel_size for s in suggestions]
    assert sizes == sorted(sizes)  # fewest GPUs per copy of the dense weights first


def test_no_suggestion_when_nothing_fits():
    assert suggest_layouts(arch("Qwen3-235B-A22B"), 1, 8, BATCH, 80 * GIB) == []


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


def test_plan_prints_the_breakdown_and_the_verdict(capsys):
    model = MODEL_CONFIGS / "Qwen3-30B-A3B.json"
    assert plan_main(["--model", str(model), "--ep", "8", "--recompute", "full", "--gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    for line in ("params", "grads", "optimizer", "activations", "transient", "opt. step", "overhead", "total"):
        assert f"\n  {line} " in out
    assert "EP 8, ETP 1, expert-DP 1" in out and "fits 141 GiB" in out


def test_suggest_lists_layouts_that_fit(capsys):
    model = MODEL_CONFIGS / "Qwen3-30B-A3B.json"
    assert plan_main(["--model", str(model), "--nodes", "4", "--suggest", "--recompute", "full", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts of 32 GPUs (4 x 8) that fit 80 GiB" in out
    assert len([line for line in out.splitlines() if line.strip().endswith("GiB      0")]) == 3


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--gpus-per-node", "3", "--tp", "3"], "--tp: the model's number of attention heads (16) is not divisible by TP=3. Fix:"),
        (["--ep", "2"], "--ep/--etp: Qwen3-1.7B (qwen3) is a dense model. Fix: drop --ep and --etp"),
        (["--micro-batch-tokens", "0"], "--micro-batch-tokens: must be positive"),
        (["--recompute", "partial"], "argument --recompute: invalid choice: 'partial'"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_flag(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", str(MODEL_CONFIGS / "Qwen3-1.7B.json"), *args])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err.splitlines()[-1]


def test_skyrl_megatron_plan_dispatches_to_the_planner_before_hydra(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    bad = subprocess.run([CLI, "plan", "--model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    last = bad.stderr.splitlines()[-1]
    assert last.startswith("skyrl-megatron plan: error: --model: model_type 'gpt2' is not supported by the planner. Fix:")
    assert "Traceback" not in bad.stderr
    good = subprocess.run([CLI, "plan", "--model", str(MODEL_CONFIGS / "Qwen3-1.7B.json")], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "fits 80 GiB" in good.stdout, good.stderr


def test_the_readme_sample_is_what_the_planner_prints(capsys):
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$ skyrl-megatron plan "))
    command, end = "", start
    while True:
        command += lines[end].removeprefix("$ skyrl-megatron plan ").rstrip("\\") + " "
        end += 1
        if not lines[end - 1].endswith("\\"):
            break
    sample = []
    while not lines[end].startswith(("$ ", "```")):
        sample.append(lines[end])
        end += 1
    assert plan_main(shlex.split(command)) == 0
    assert capsys.readouterr().out.strip() == "\n".join(sample).strip()


def test_the_planner_imports_neither_torch_nor_megatron():
    probe = "import sys, skyrl_megatron.planner.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers', 'hydra'}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_logits_chunk_budget_reaches_the_logprob_head_term():
    """`--logits-chunk-mib` is `megatron_config.logits_chunk_mib`: the eager head holds EAGER_LOGITS_CHUNK_BUFFERS fp32
    chunks; the fused head one recomputed chunk's bf16 logits (half the fp32 budget), and none where the training
    forward kept every logit (1.7B at 8,192 tokens: 2.3 GiB of bf16 logits, within the 4 GiB kept by default)."""
    from skyrl_megatron.planner.memory import EAGER_LOGITS_CHUNK_BUFFERS, _logprob_head_bytes

    model, layout = load_model_arch(MODEL_CONFIGS / "Qwen3-1.7B.json"), Layout(gpus_per_node=1)
    growth = (1024 - 256) * 2**20
    for fields, grows_by in (({"logprobs_fusion": False}, EAGER_LOGITS_CHUNK_BUFFERS * growth),
                             ({"logits_kept_bytes": 0}, growth // 2),
                             ({}, 0)):
        small, large = (_logprob_head_bytes(model, layout, BatchPlan(8192, logits_chunk_bytes=mib * 2**20, **fields),
                                            TrainingSetup()) for mib in (256, 1024))
        assert large - small == grows_by, fields
    base = ["--model", str(MODEL_CONFIGS / "Qwen3-1.7B.json"), "--micro-batch-tokens", "8192", "--unfused-logprobs"]
    small, large = (estimate_from_argv([*base, "--logits-chunk-mib", str(mib)]) for mib in (256, 1024))
    assert small.transient_source == large.transient_source == "logprob head"
    assert large.transient - small.transient == EAGER_LOGITS_CHUNK_BUFFERS * growth


def test_the_head_accumulates_its_weight_gradient_only_where_it_cannot_go_into_an_fp32_main_grad(capsys):
    """With gradient_accumulation_fusion and fp32 gradient buffers (the defaults) the output weight's gradient goes
    into main_grad; without either, the head adds an fp32 [V, h] accumulator and its bf16 cast; LoRA freezes it."""
    from skyrl_megatron.planner.memory import _logprob_head_bytes

    model = load_model_arch(MODEL_CONFIGS / "Qwen3-1.7B.json")
    layout = Layout(gpus_per_node=1)
    accumulator = (4 + 2) * model.vocab_size * model.hidden_size
    fused = _logprob_head_bytes(model, layout, BATCH, TrainingSetup())
    for setup in (TrainingSetup(gradient_accumulation_fusion=False), TrainingSetup(grad_reduce_in_fp32=False)):
        assert setup.head_accumulates_weight_grad
        assert _logprob_head_bytes(model, layout, BATCH, setup) - fused == accumulator
    lora = TrainingSetup(lora_rank=16, gradient_accumulation_fusion=False)
    assert not lora.head_accumulates_weight_grad
    assert _logprob_head_bytes(model, layout, BATCH, lora) == fused
    assert estimate_from_argv(["--model", str(MODEL_CONFIGS / "Qwen3-1.7B.json"), "--no-gradient-accumulation-fusion"]).transient \
        == estimate(model, layout, BATCH, TrainingSetup(gradient_accumulation_fusion=False)).transient
    base = ["--model", str(MODEL_CONFIGS / "Qwen3-1.7B.json")]
    assert plan_main(base) == 0 and "logprob head:" not in capsys.readouterr().out
    assert plan_main([*base, "--unfused-logprobs", "--no-gradient-accumulation-fusion"]) == 0
    assert "logprob head: eager (fp32 chunks), output weight gradient in an fp32 buffer of its own" in capsys.readouterr().out


def test_the_plan_takes_the_logprob_heads_default_chunk():
    """The planner (no torch imports) keeps its own copy of the head's default chunk budget: the same value
    as the head's and as `megatron_config.logits_chunk_mib`'s default."""
    from skyrl_megatron.compute.logprobs import DEFAULT_LOGITS_CHUNK_BYTES as head_default
    from skyrl_megatron.config import MegatronWorkerConfig
    from skyrl_megatron.planner.memory import DEFAULT_LOGITS_CHUNK_BYTES as planner_default

    assert planner_default == head_default == MegatronWorkerConfig().logits_chunk_mib * 2**20
    assert BatchPlan(8192).logits_chunk_bytes == planner_default


def test_the_plan_keeps_the_logits_the_head_keeps():
    """The planner's copies of the kept-logits default and of the head's whole-chunk rule (`kept_logits_tokens`)
    agree with the head's and with `megatron_config.logits_kept_mib`."""
    from skyrl_megatron.compute.logprobs import DEFAULT_LOGITS_KEPT_BYTES as head_default
    from skyrl_megatron.compute.logprobs import chunk_tokens_for, kept_logits_tokens
    from skyrl_megatron.config import MegatronWorkerConfig
    from skyrl_megatron.planner.memory import DEFAULT_LOGITS_KEPT_BYTES as planner_default
    from skyrl_megatron.planner.memory import _kept_logits_bytes

    assert planner_default == head_default == MegatronWorkerConfig().logits_kept_mib * 2**20
    assert BatchPlan(8192).logits_kept_bytes == planner_default
    vocab_rows = 151936
    for tokens, kept_mib in ((8192, 4096), (16384, 4096), (16384, 1024), (4096, 0)):
        batch = BatchPlan(tokens, logits_kept_bytes=kept_mib * 2**20)
        kept_tokens = kept_logits_tokens(tokens, chunk_tokens_for(vocab_rows, batch.logits_chunk_bytes), vocab_rows,
                                         2, batch.logits_kept_bytes)
        assert _kept_logits_bytes(tokens, vocab_rows, batch) == kept_tokens * vocab_rows * 2, (tokens, kept_mib)
