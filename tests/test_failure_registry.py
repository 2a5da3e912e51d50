"""A worker registers in the failure registry (`failures.py`) without waiting for it: the registry's actor
may still be starting when the first worker's process groups are up (on a 2-core machine that wait was 7 s of
every start). Here the registry is held shut until the worker's call has returned."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray

from skyrl_megatron.failures import (
    REGISTRY_NAME,
    WorkerFailure,
    WorkerIdentity,
    dead_actors,
    dead_workers,
    explain,
    register_current_worker,
    start_registry,
)

GATE_TIMEOUT_S = 120  # how long the held registry waits for its gate before giving up (a broken test, not a pass)


@ray.remote(num_cpus=0, max_concurrency=2)  # two threads: `entries` answers while `register` is held
class _HeldRegistry:
    def __init__(self, gate: str):
        self.gate, self.workers = gate, {}

    def register(self, actor_id, identity, handle) -> None:
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.workers[actor_id] = identity

    def entries(self) -> dict:
        return dict(self.workers)


@ray.remote(num_cpus=0)
class _Worker:
    def come_up(self) -> bool:
        register_current_worker("policy", 1, 2, "dp 0, cp 0, tp 1, pp 0")
        return True


@pytest.mark.slow
def test_a_worker_registers_without_waiting_for_the_registry(tmp_path):
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        gate = tmp_path / "gate"
        registry = _HeldRegistry.options(name=REGISTRY_NAME).remote(str(gate))
        worker = _Worker.remote()
        # returns while the registry cannot take the call (a waiting worker would time out here)
        assert ray.get(worker.come_up.remote(), timeout=GATE_TIMEOUT_S / 2)
        assert ray.get(registry.entries.remote()) == {}
        gate.touch()
        for _ in range(600):  # the call submitted above is delivered once the registry takes it
            (identity,) = ray.get(registry.entries.remote()).values() or (None,)
            if identity is not None:
                break
            time.sleep(0.1)
        assert identity is not None, "the registration never reached the registry"
        assert (identity.role, identity.rank, identity.world_size) == ("policy", 1, 2)
        assert identity.pid != os.getpid()  # the worker's own process
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_registry_that_died_with_the_workers_is_named_not_raised():
    """When Ray's processes are ended from outside (the host's OOM killer), the registry dies with the
    workers; explaining the failure must not fail on the registry in turn."""
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        start_registry()
        registry = ray.get_actor(REGISTRY_NAME)
        assert ray.get(registry.entries.remote()) == {}
        assert dead_workers() == []
        ray.kill(registry, no_restart=True)
        failure = explain(RuntimeError("The actor died unexpectedly before finishing this task."))
        assert isinstance(failure, WorkerFailure)
        assert "failure registry's among them" in str(failure)
        assert "First error seen: The actor died unexpectedly" in str(failure)
    finally:
        ray.shutdown()


@ray.remote(max_retries=0)
def _killed_by_the_memory_monitor():
    raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")


class _MemoryMonitorVictim:
    """Stand-in for the handle of an actor that Ray's memory monitor killed (making the node run out of
    memory is not something a test can do safely): its readiness probe fails as that actor's does, with
    Ray's OutOfMemoryError, not RayActorError."""

    class _Probe:
        @staticmethod
        def remote():
            return _killed_by_the_memory_monitor.remote()

    __ray_ready__ = _Probe()

    class _actor_id:
        @staticmethod
        def hex():
            return "ff" * 16


@pytest.mark.slow
def test_a_worker_killed_by_rays_memory_monitor_is_named_dead():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        assert dead_actors([_MemoryMonitorVictim()], ["policy worker rank 0/1"]) == ["policy worker rank 0/1"]
        start_registry()
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the registry's process cannot import tests
        identity = WorkerIdentity("policy", 0, 1, "dp 0, cp 0, tp 0, pp 0", 4242, "10.0.0.1")
        ray.get(ray.get_actor(REGISTRY_NAME).register.remote("ff" * 16, identity, _MemoryMonitorVictim()))
        try:
            ray.get(_killed_by_the_memory_monitor.remote())
        except ray.exceptions.OutOfMemoryError as error:
            failure = explain(error)
        assert isinstance(failure, WorkerFailure)
        assert str(failure).startswith("1 process(es) died: policy worker rank 0/1 (dp 0, cp 0, tp 0, pp 0; pid 4242")
        assert "the node's host memory ran out" in str(failure) and "async_save=false" in str(failure)
    finally:
        ray.shutdown()
