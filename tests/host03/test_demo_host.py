"""The demo's parts that only skyrl-train 0.3.1 has: its prompt file loads in 0.3.1's own dataset (on skyrl
0.4 the demo run itself loads it: tests/test_e2e_grpo.py), and `demo --gpus N` (the HF engine colocated with
the trainers, through 0.3.1's CUDA IPC sender; skyrl 0.4 refuses it by name). The demo's other parts:
tests/test_demo.py."""

from __future__ import annotations

import json

import pytest

from skyrl_megatron.demo.task import ENV_ID, write_prompts


def test_prompt_file_loads_in_the_hosts_dataset(tmp_path):
    from skyrl_train.dataset import PromptDataset

    from skyrl_megatron.testing import make_tiny_tokenizer

    path = write_prompts(tmp_path / "prompts.jsonl", 12)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and all(row["env_class"] == ENV_ID for row in rows)
    dataset = PromptDataset(str(path), make_tiny_tokenizer(), max_prompt_length=64, num_workers=1)
    assert len(dataset) == 12
    messages, env_class, _, uid = dataset[3]
    assert env_class == ENV_ID and uid == "3" and messages[0]["role"] == "user"


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_gpu_demo_replaces_the_cpu_settings_and_validates(tmp_path, gpus):
    """`demo --gpus N`: each CPU setting it changes is replaced, not given twice, and the result passes our
    checks; on 2 GPUs the policy and the reference are tensor parallel over both, one engine per GPU."""
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.demo.__main__ import demo_overrides, gpu_overrides, merged, prepare
    from skyrl_megatron.validation import validate_config

    model_dir, prompts = prepare(tmp_path, steps=2)
    overrides = merged(demo_overrides(tmp_path, model_dir, prompts, steps=2, ckpt_interval=1), gpu_overrides(gpus))
    keys = [item.split("=", 1)[0] for item in overrides]
    assert len(keys) == len(set(keys))
    assert {"generator.engine=gpu", "trainer.placement.colocate_all=true", "trainer.bf16=true"} <= set(overrides)
    cfg = compose_config(overrides)
    validate_config(cfg)
    for role in ("policy", "ref"):
        assert cfg.trainer.placement[f"{role}_num_gpus_per_node"] == gpus
        assert cfg.trainer[role].megatron_config.tensor_model_parallel_size == gpus
    assert cfg.generator.num_inference_engines == gpus
