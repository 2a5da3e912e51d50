"""Which token budget a worker's pass takes: scoring may have its own (`forward_max_tokens_per_microbatch`,
no activations kept for backward), training takes `max_tokens_per_microbatch`; an out-of-memory names
the budget of the pass that failed; the host's request to empty the CUDA cache between passes is kept where
the placement shares the worker's GPUs, and follows `empty_cuda_cache`."""

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
@pytest.mark.parametrize("placement", [{}, {"colocate_all": True}, {"colocate_policy_ref": True}])
def test_the_cuda_cache_goes_back_where_another_process_can_take_it(stand_in_worker, monkeypatch, empty, placement):
    """The host asks after every scoring and training call: the pool goes back where the placement shares the
    worker's GPUs, and after every offload, unless `empty_cuda_cache` is false; on GPUs of its own it is kept
    between passes (a GPU runtime stood in by its flag: torch.cuda.empty_cache is counted, not run)."""
    import types

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    worker = stand_in_worker({"empty_cuda_cache": empty}, placement=placement)
    worker.runtime = types.SimpleNamespace(is_cpu=False)
    worker.empty_cache()
    assert len(calls) == (1 if empty and placement else 0)

    calls.clear()
    worker.offloader = types.SimpleNamespace(offload=lambda **kwargs: types.SimpleNamespace(as_dict=dict))
    worker.transfer_log = types.SimpleNamespace(add=lambda report: None)
    worker.offload_to_cpu()
    assert len(calls) == (1 if empty else 0)  # what an offload is for, shared GPUs or not

    calls.clear()
    worker.runtime = types.SimpleNamespace(is_cpu=True)
    worker.empty_cache()  # no CUDA cache on the CPU runtime
    worker.offload_to_cpu()
    assert calls == []
