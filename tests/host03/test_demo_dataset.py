"""The demo's prompt file loads in skyrl-train 0.3.1's own dataset (on skyrl 0.4 the demo run itself
loads it: tests/test_e2e_grpo.py). The demo's other host-independent parts: tests/test_demo.py."""

from __future__ import annotations

import json

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
