"""An allocator failure inside a worker's step becomes one error naming the worker and the knobs.

The failure here is real: the CPU allocator refusing a petabyte, raised inside the guard exactly as a
step's activation allocation would be.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.workers.out_of_memory import StepKnobs, WorkerOutOfMemory, explains_out_of_memory

WORKER = "policy worker rank 1/2 (dp 0, cp 0, tp 1, pp 0)"


def _knobs(max_tokens=None, recompute=None, key="max_tokens_per_microbatch") -> StepKnobs:
    return StepKnobs(role="policy", token_budget_key=key, token_budget=max_tokens,
                     micro_batch_key="trainer.micro_train_batch_size_per_gpu", micro_batch_size=4,
                     recompute_granularity=recompute)


def _allocate_too_much() -> None:
    torch.empty(2**50, dtype=torch.uint8)


def test_training_oom_names_the_worker_the_token_budget_and_recompute():
    with pytest.raises(WorkerOutOfMemory) as raised:
        with explains_out_of_memory(WORKER, "training", _knobs(max_tokens=8192)):
            _allocate_too_much()
    message = str(raised.value)
    assert message.startswith(f"{WORKER} ran out of memory while training (")
    assert "lower trainer.policy.megatron_config.max_tokens_per_microbatch (now 8192)" in message
    assert "trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=full (now off)" in message
    # the step's frames (and their tensors) are no longer referenced by the error that travels
    assert raised.value.__suppress_context__ and raised.value.__context__.__traceback__ is None


def test_without_a_token_budget_the_message_offers_one_and_the_micro_batch_size():
    with pytest.raises(WorkerOutOfMemory) as raised:
        with explains_out_of_memory(WORKER, "scoring", _knobs()):
            _allocate_too_much()
    message = str(raised.value)
    assert "set trainer.policy.megatron_config.max_tokens_per_microbatch" in message
    assert "trainer.micro_train_batch_size_per_gpu (now 4)" in message
    assert "recompute" not in message  # scoring keeps no activations for backward


def test_full_recompute_is_not_offered_again_and_other_errors_pass_unchanged():
    with pytest.raises(WorkerOutOfMemory) as raised:
        with explains_out_of_memory(WORKER, "training", _knobs(max_tokens=4096, recompute="full")):
            _allocate_too_much()
    assert "recompute" not in str(raised.value)
    with pytest.raises(ValueError, match="unrelated"):
        with explains_out_of_memory(WORKER, "training", _knobs()):
            raise ValueError("unrelated")
    with explains_out_of_memory(WORKER, "training", _knobs()):
        pass  # a step that fits raises nothing


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
])
def test_gpu_allocator_failures_outside_the_caching_allocator_are_named_too(error):
    """On a GPU an allocation can fail in cuBLAS's workspace or a kernel's own cudaMalloc: a RuntimeError in
    that library's words, not torch.OutOfMemoryError. They get the same message; other CUDA errors do not."""
    with pytest.raises(WorkerOutOfMemory, match=r"ran out of memory while training \((CUDA|.*CUBLAS)"):
        with explains_out_of_memory(WORKER, "training", _knobs(max_tokens=8192)):
            raise error
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with explains_out_of_memory(WORKER, "training", _knobs()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_the_driver_gets_the_workers_message_without_rays_wrapping():
    """Through Ray a worker's WorkerOutOfMemory arrives as RayTaskError(WorkerOutOfMemory) whose text is
    the remote traceback; nested once more when the trainer ran in a Ray task. The driver unwraps it to
    the worker's own exception; any other task error stays Ray's."""
    import ray

    from skyrl_megatron.failures import ReportedFailure, reported_failure

    with pytest.raises(WorkerOutOfMemory) as raised:
        with explains_out_of_memory(WORKER, "training", _knobs(max_tokens=8192)):
            _allocate_too_much()
    original = raised.value

    in_worker = ray.exceptions.RayTaskError("ppo_train", "Traceback (most recent call last): ...", original)
    at_trainer = in_worker.as_instanceof_cause()
    in_task = ray.exceptions.RayTaskError("_run_experiment_in_task", "Traceback ...", at_trainer)
    assert isinstance(at_trainer, WorkerOutOfMemory) and str(at_trainer) != str(original)  # Ray's text, not the worker's
    for wrapped in (at_trainer, in_task):
        unwrapped = reported_failure(wrapped)
        assert unwrapped is original and isinstance(unwrapped, ReportedFailure)
        assert str(unwrapped).startswith(f"{WORKER} ran out of memory while training") and "Traceback" not in str(unwrapped)

    other = ray.exceptions.RayTaskError("ppo_train", "Traceback ...", ValueError("bad shape")).as_instanceof_cause()
    assert reported_failure(other) is None
    assert reported_failure(ValueError("bad shape")) is None


def test_a_scoring_oom_names_the_scoring_budget_when_scoring_has_its_own():
    with pytest.raises(WorkerOutOfMemory) as raised:
        with explains_out_of_memory(WORKER, "scoring", _knobs(max_tokens=32768, key="forward_max_tokens_per_microbatch")):
            _allocate_too_much()
    assert "lower trainer.policy.megatron_config.forward_max_tokens_per_microbatch (now 32768)" in str(raised.value)
