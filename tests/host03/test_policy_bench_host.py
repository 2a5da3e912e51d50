"""The benchmark's FSDP2 baseline on its host, skyrl-train 0.3.1 (what the GPU machines run): the
benchmark batch converts through 0.3.1's training iterator and its HF wrapper loads SDPA for the baseline.

The host-independent parts of the benchmark harness: tests/test_policy_bench.py.
"""

from __future__ import annotations

import torch
from test_policy_bench import _bench_module


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
