"""A training call's metrics read after the optimizer step is queued (`compute/pending_metrics.py`).

`train_mini_batch(..., defer_metrics=True)` queues the metrics' sums and collectives and returns them unread; the
workers queue the optimizer step before reading them, so the host prepares the step while the device finishes the
backward. Checked: the sums are queued with no host read until `read`, and on a tiny MoE (CPU, world 1, router load
metrics attached) the deferred metrics equal the ones read at once, name for name and bit for bit.
"""

from __future__ import annotations

import pytest

from skyrl_megatron.compute.pending_metrics import PendingMetrics
from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks


def test_readers_run_only_when_read_in_the_order_joined():
    calls = []

    def reader(name, value):
        def read():
            calls.append(name)
            return {name: value, "shared": value}
        return read

    pending = PendingMetrics(reader("a", 1.0)).joined(PendingMetrics(reader("b", 2.0)))
    assert calls == []
    assert pending.read() == {"a": 1.0, "b": 2.0, "shared": 2.0}  # a later reader's name wins, as dict.update
    assert calls == ["a", "b"]
    assert PendingMetrics().read() == {}


def test_the_mini_batch_sums_are_queued_without_a_host_read(monkeypatch):
    """`mini_batch_metrics` sums on the device and reads nothing on the host until `read` (one `tolist`)."""
    import torch
    from megatron.core import parallel_state as ps

    from skyrl_megatron.compute.losses import mini_batch_metrics
    from skyrl_megatron.testing.host_syncs import HostSyncProbe

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_last_rank", lambda: 0)
    per_micro_batch = [
        {"loss": torch.tensor(0.25, dtype=torch.float64), "clipfrac": torch.tensor(0.125, dtype=torch.float64)},
        {"loss": torch.tensor(0.5, dtype=torch.float64)},
    ]
    with HostSyncProbe() as queued:
        pending = mini_batch_metrics(per_micro_batch, None, torch.device("cpu"))
    assert queued.found == [], queued.report()
    with HostSyncProbe() as read:
        assert pending.read() == {"clipfrac": 0.125, "loss": 0.75}
    assert [s.what for s in read.found] == ["Tensor.tolist"], read.report()


def _read_now_and_later(rank, world_size, hf_dir: str) -> dict:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from skyrl_megatron.compute.router_metrics import RouterMetrics
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing.policy_steps import policy_gradient_objective
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    init_distributed("cpu")
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True,
                                  ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}))
    get_model_config(built.chunks[0]).finalize_model_grads_func = finalize_model_grads
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_router_metrics(RouterMetrics.attach(built.chunks))
    batch = make_rl_batch(6, 6, 6, seed=5)
    args = (batch["sequences"], batch["attention_mask"],
            {"loss_mask": batch["loss_mask"], "advantages": batch["advantages"]},
            policy_gradient_objective, MicroBatching(micro_batch_size=2))
    now = runner.train_mini_batch(*args)  # no optimizer step: the second call sees the same weights
    pending = runner.train_mini_batch(*args, defer_metrics=True)
    return {"now": now, "deferred_type": type(pending).__name__, "later": pending.read()}


@pytest.mark.slow
def test_deferred_training_metrics_equal_the_metrics_read_at_once(tmp_path):
    make_tiny_hf_model("qwen3_moe", tmp_path, seed=11)
    (result,) = run_on_ranks(_read_now_and_later, 1, str(tmp_path), timeout=600)
    assert result["deferred_type"] == "PendingMetrics"
    now, later = result["now"], result["later"]
    assert "loss" in now and any(name.startswith("moe/") for name in now)  # the router load joined
    assert later == now
