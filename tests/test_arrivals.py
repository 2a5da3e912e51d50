"""Optimizer state on its way back to the GPU (`skyrl_megatron.arrivals`): its first reader waits for it.

On a GPU the offloader brings the optimizer's state back on a stream of its own and registers the wait
(bench/gpu_offload_overlap_check.py checks the copies against a synchronous backload there). Here: every lookup a
reader of that state goes through runs the wait, once, before the state is touched; on the CPU runtime a backload
stays synchronous and registers nothing.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from skyrl_megatron import arrivals


def _arriving(owner, events: list[str]) -> None:
    arrivals.expect(owner, lambda: events.append("waited"))


def test_the_lookups_of_optimizer_state_wait_once_for_it():
    from skyrl_megatron.master_weights import compact_masters_of
    from skyrl_megatron.optim import torch_optimizers

    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([parameter])
    for lookup in (torch_optimizers, compact_masters_of):
        events: list[str] = []
        _arriving(optimizer, events)
        assert arrivals.arriving(optimizer)
        lookup(optimizer)
        lookup(optimizer)
        assert events == ["waited"], lookup.__name__
        assert not arrivals.arriving(optimizer)


def test_the_optimizer_step_waits_before_it_reads_the_gradients_or_the_state():
    from skyrl_megatron.optim import optimizer_step

    events: list[str] = []

    class Optimizer:  # the calls `optimizer_step` makes of a Megatron optimizer, recorded
        param_groups = [{"lr": 0.5, "is_decoupled_lr": False}]
        config = SimpleNamespace(clip_grad=1.0, log_num_zeros_in_grad=False, grad_norm_skip_threshold=math.inf)

        def prepare_grads(self):
            events.append("prepare_grads")
            return False

        def get_grad_norm(self):
            events.append("grad_norm")
            return 1.0

        def has_grad_norm_group(self, group):
            return False

        def get_parameters(self):
            events.append("parameters")
            return []

        def step_with_ready_grads(self):
            events.append("step")
            return True

    class Scheduler:
        def step(self, increment):
            events.append("schedule")

    optimizer = Optimizer()
    _arriving(optimizer, events)
    result = optimizer_step(optimizer, Scheduler())
    assert events == ["waited", "prepare_grads", "grad_norm", "parameters", "step", "schedule"]
    assert not result.skipped


def test_a_second_arrival_first_waits_for_the_one_before():
    owner = torch.nn.Linear(2, 2)
    events: list[str] = []
    arrivals.expect(owner, lambda: events.append("first"))
    arrivals.expect(owner, lambda: events.append("second"))
    assert events == ["first"]
    arrivals.settle(owner)
    arrivals.settle(owner)
    assert events == ["first", "second"]
    arrivals.settle(None)  # a worker without an optimizer


def test_on_the_cpu_runtime_a_backload_is_synchronous_and_registers_nothing():
    from skyrl_megatron.workers.offload import ModelOffloader

    parameter = torch.nn.Parameter(torch.randn(64))
    optimizer = torch.optim.AdamW([parameter])
    parameter.grad = torch.randn(64)
    optimizer.step()
    state = {k: v.clone() for k, v in optimizer.state[parameter].items()}
    offloader = ModelOffloader([])
    offloader.offload(model=False, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
    assert optimizer.state[parameter]["exp_avg"].untyped_storage().nbytes() == 0
    offloader.backload(model=False, optimizer=True, optimizer_obj=optimizer)
    assert not arrivals.arriving(optimizer)
    assert all(torch.equal(optimizer.state[parameter][k], v) for k, v in state.items())
