"""The example launch scripts in examples/megatron: each one, run with a stand-in `skyrl-megatron`,
gives overrides that compose and pass the full validation (ours and the host's) for the world size it
plans; its pasted memory plan is what the planner prints today for exactly its layout, and fits the GPU
its header names. The architecture JSONs carry the published shapes and load in transformers.

The scripts are written in skyrl-train 0.3.1's keys, which skyrl 0.4 takes too (its adapter renames the
moved generator keys); the same checks run on both hosts (tests/host03/test_examples_on_skyrl_train.py),
each reading the composed config through our view of it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from skyrl_megatron.cli import compose_config
from skyrl_megatron.hosts import current
from skyrl_megatron.validation import validate_config
from skyrl_megatron.planner.cli import build_parser
from skyrl_megatron.planner.cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the example readers are the bench's (bench/example_layouts.py)
from example_layouts import EXAMPLES, MODEL_CONFIGS, launch_overrides, model_config_of, plan_of, scale_example  # noqa: E402

SCRIPTS = sorted(EXAMPLES.glob("run_*.sh"))
PLANNED = [s for s in SCRIPTS if s.name != "run_fsdp_baseline.sh"]
GPU_MEMORY_GIB = {"H100": 80, "H200": 141}
HARDWARE = re.compile(r"^# Hardware: (\d+) nodes? x (\d+) (H100|H200) \((\d+) GiB each\)", re.MULTILINE)

# Published shapes (model cards / config.json on the Hub).
PUBLISHED = {
    "Qwen3-0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                            tie_word_embeddings=False),
}  # fmt: skip


def our_view(host_cfg):
    """The composed config as our checks and workers read it (skyrl-train 0.3.1's shape, on either host)."""
    return current().our_view(host_cfg)


def test_every_example_is_covered():
    assert {s.name for s in SCRIPTS} == {
        "run_qwen3_1.7b_grpo.sh",
        "run_qwen3_30b_a3b_1node.sh",
        "run_qwen3_30b_a3b_4nodes.sh",
        "run_qwen3_235b_a22b.sh",
        "run_fsdp_baseline.sh",
    }
    for script in SCRIPTS:
        assert os.access(script, os.X_OK), f"chmod +x {script.name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_overrides_compose_and_pass_validation(script, tmp_path):
    overrides = launch_overrides(script, tmp_path)
    assert overrides[-1].startswith("trainer.run_name=")  # nothing after "$@" was lost
    host_cfg = compose_config(overrides)
    validate_config(host_cfg)  # ours (layout against the model's shape) and the host's validate_cfg
    cfg = our_view(host_cfg)
    assert cfg.trainer.policy.model.path == str(tmp_path / "model")
    placement = cfg.trainer.placement
    engines = cfg.generator.num_inference_engines * cfg.generator.inference_engine_tensor_parallel_size
    assert placement.colocate_all and engines == placement.policy_num_nodes * placement.policy_num_gpus_per_node
    assert cfg.generator.backend == "vllm"
    if cfg.trainer.algorithm.use_kl_loss:  # the reference model runs the policy's layout
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            assert cfg.trainer.ref.megatron_config[key] == cfg.trainer.policy.megatron_config[key]


def test_extra_arguments_reach_the_command_last(tmp_path):
    overrides = launch_overrides(EXAMPLES / "run_qwen3_1.7b_grpo.sh", tmp_path, "trainer.epochs=1")
    assert overrides[-1] == "trainer.epochs=1"


@pytest.mark.parametrize("script", PLANNED, ids=lambda s: s.name)
def test_pasted_memory_plan_is_current_matches_the_layout_and_fits(script, tmp_path):
    argv, pasted = plan_of(script)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert plan_main(argv) == 0
    assert printed.getvalue().rstrip("\n") == pasted, f"re-run the plan command in {script.name} and paste its output"
    total = [line for line in pasted.splitlines() if line.strip().startswith("total")]
    assert len(total) == 1 and " fits " in total[0]

    readme_rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `{script.name}` |")]
    planned_gib = float(total[0].split()[1])
    assert len(readme_rows) == 1 and readme_rows[0].rstrip(" |").endswith(f"| {planned_gib:.1f} GiB"), (
        f"README's example table: give {script.name} its plan per GPU, {planned_gib:.1f} GiB"
    )

    plan = build_parser().parse_args(argv)
    assert ROOT / plan.model == model_config_of(script)
    ((nodes, gpus, gpu, gib),) = HARDWARE.findall(script.read_text())
    assert (plan.nodes, plan.gpus_per_node) == (int(nodes), int(gpus))
    assert plan.gpu_memory_gib == int(gib) == GPU_MEMORY_GIB[gpu]

    cfg = our_view(compose_config(launch_overrides(script, tmp_path)))
    placement, mc = cfg.trainer.placement, cfg.trainer.policy.megatron_config
    assert (placement.policy_num_nodes, placement.policy_num_gpus_per_node) == (plan.nodes, plan.gpus_per_node)
    planned = (plan.tp, plan.pp, plan.vpp, plan.cp, plan.ep, plan.etp if plan.etp is not None else plan.tp)
    configured = (
        mc.tensor_model_parallel_size,
        mc.pipeline_model_parallel_size,
        mc.virtual_pipeline_model_parallel_size,
        mc.context_parallel_size,
        mc.expert_model_parallel_size,
        mc.expert_tensor_parallel_size if mc.expert_tensor_parallel_size is not None else mc.tensor_model_parallel_size,
    )
    assert planned == configured
    assert plan.micro_batch_tokens == mc.max_tokens_per_microbatch
    assert plan.recompute == (mc.transformer_config_kwargs.recompute_granularity or "none")
    assert plan.no_sequence_parallel != mc.sequence_parallel
    swiglu_fused = mc.transformer_config_kwargs.get("bias_activation_fusion")
    if swiglu_fused is None:
        swiglu_fused = "swiglu" in mc.fused_kernels
    assert plan.unfused_swiglu != swiglu_fused
    assert plan.unfused_logprobs != ("logprobs" in mc.fused_kernels)
    assert plan.no_gradient_accumulation_fusion != mc.transformer_config_kwargs.get("gradient_accumulation_fusion", True)
    assert plan.lora_rank == cfg.trainer.policy.model.lora.rank
    assert plan.no_grad_reduce_in_fp32 != mc.ddp_config.grad_reduce_in_fp32
    assert plan.no_distributed_optimizer != mc.ddp_config.use_distributed_optimizer
    assert plan.compact_master_weights == mc.compact_master_weights
    assert plan.compact_adam == mc.compact_adam
    offloaded = mc.optimizer_config_kwargs.optimizer_offload_fraction if mc.optimizer_config_kwargs.optimizer_cpu_offload else 0.0
    assert plan.optimizer_offload_fraction == offloaded


def test_fsdp_baseline_trains_the_same_run_with_the_hosts_fsdp2(tmp_path):
    megatron = our_view(compose_config(launch_overrides(EXAMPLES / "run_qwen3_1.7b_grpo.sh", tmp_path / "megatron")))
    fsdp = our_view(compose_config(launch_overrides(EXAMPLES / "run_fsdp_baseline.sh", tmp_path / "fsdp")))
    assert (megatron.trainer.strategy, fsdp.trainer.strategy) == ("megatron", "fsdp2")
    assert model_config_of(EXAMPLES / "run_fsdp_baseline.sh") == model_config_of(EXAMPLES / "run_qwen3_1.7b_grpo.sh")
    for section in ("generator", "environment", "trainer.algorithm", "trainer.placement", "trainer.policy.optimizer_config"):
        assert _select(fsdp, section) == _select(megatron, section), section
    for key in ("train_batch_size", "policy_mini_batch_size", "max_prompt_length", "epochs", "use_sample_packing"):
        assert fsdp.trainer[key] == megatron.trainer[key], key


def _select(cfg, dotted: str):
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, dotted)
    data = OmegaConf.to_container(node, resolve=True)
    data.pop("model_name", None)  # the model path: each run's own temp directory here
    return data


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_configs_carry_the_published_shape_and_load_in_transformers(name, tmp_path):
    from transformers import AutoConfig

    config = json.loads((MODEL_CONFIGS / f"{name}.json").read_text())
    assert {k: config[k] for k in PUBLISHED[name]} == PUBLISHED[name]
    assert config["vocab_size"] == 151936
    assert config["architectures"] == ["Qwen3MoeForCausalLM" if "num_experts" in PUBLISHED[name] else "Qwen3ForCausalLM"]
    shutil.copy(MODEL_CONFIGS / f"{name}.json", tmp_path / "config.json")
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.model_type == config["model_type"]
    assert loaded.num_hidden_layers == config["num_hidden_layers"]


def test_the_full_size_one_node_30b_example_keeps_every_layer_and_its_layout(tmp_path):
    """The full-size run (`bench/gpu_examples.py --full-size --gpus 8`): the 30B-A3B one-node script on the 8 GPUs
    its header names keeps the published 48 layers, and the planner is asked about exactly its pasted plan."""
    script = EXAMPLES / "run_qwen3_30b_a3b_1node.sh"
    example = scale_example(script, tmp_path / "launch", gpus=8, full_size=True)
    assert example.model_config["num_hidden_layers"] == PUBLISHED["Qwen3-30B-A3B"]["num_hidden_layers"] == 48
    pasted = build_parser().parse_args(plan_of(script)[0])
    full = build_parser().parse_args(["--model", str(model_config_of(script)), *example.planner_args])
    for key in ("nodes", "gpus_per_node", "tp", "pp", "cp", "ep", "etp", "micro_batch_tokens", "recompute"):
        assert getattr(full, key) == getattr(pasted, key), key
    scaled = scale_example(script, tmp_path / "scaled", gpus=2)
    assert scaled.model_config["num_hidden_layers"] == 4  # the 2-GPU runs (docs/results/examples_s*) stay as they were
