"""Which token budget a worker's pass takes: scoring may have its own (`forward_max_tokens_per_microbatch`,
no activations kept for backward), training takes `max_tokens_per_microbatch`; an out-of-memory names
the budget of the pass that failed; the host's request to empty the CUDA cache between passes follows
`empty_cuda_cache`."""

from __future__ import annotations

import re

import pytest
import torch

from skyrl_megatron.workers.out_of_memory import WorkerOutOfMemory


def test_scoring_takes_its_own_budget_and_training_the_training_one(stand_in_worker):
    worker = stand_in_worker({"max_tokens_per_microbatch": 8192, "forward_max_tokens_per_microbatch": 32768})
    scoring, training = worker._batching(2, "scoring"), worker._batching(1, "training")
    assert (scoring.max_tokens, scoring.micro_batch_size) == (32768, 2)
    assert (training.max_tokens, training.micro_batch_size) == (8192, 1)


def test_without_a_scoring_budget_scoring_takes_four_times_the_training_one_and_names_its_own_key(stand_in_worker):
    worker = stand_in_worker({"max_tokens_per_microbatch": 8192})
    assert worker._batching(1, "training").max_tokens == 8192
    assert worker._batching(2, "scoring").max_tokens == 4 * 8192
    assert worker._token_budget("scoring") == ("forward_max_tokens_per_microbatch", 4 * 8192)
    assert stand_in_worker()._batching(2, "scoring").max_tokens is None  # rows, as the host splits them


@pytest.mark.parametrize("phase,named", [("scoring", "forward_max_tokens_per_microbatch (now 32768)"),
                                         ("training", "max_tokens_per_microbatch (now 8192)")])
def test_an_out_of_memory_names_the_budget_of_its_pass(stand_in_worker, phase, named):
    worker = stand_in_worker({"max_tokens_per_microbatch": 8192, "forward_max_tokens_per_microbatch": 32768})
    with pytest.raises(WorkerOutOfMemory, match=re.escape(f"lower trainer.policy.megatron_config.{named}")):
        with worker._step_guard(phase):
            torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator refuses, as a GPU's would


@pytest.mark.parametrize("empty", [True, False])
def test_the_hosts_empty_cache_request_follows_empty_cuda_cache(stand_in_worker, monkeypatch, empty):
    """The host asks after every scoring and training call; a worker on GPUs of its own may keep its pool
    (a GPU runtime stood in by its flag: torch.cuda.empty_cache is counted, not run)."""
    import types

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    worker = stand_in_worker({"empty_cuda_cache": empty})
    worker.runtime = types.SimpleNamespace(is_cpu=False)
    worker.empty_cache()
    assert len(calls) == (1 if empty else 0)
    worker.runtime = types.SimpleNamespace(is_cpu=True)
    worker.empty_cache()  # no CUDA cache on the CPU runtime
    assert len(calls) == (1 if empty else 0)
