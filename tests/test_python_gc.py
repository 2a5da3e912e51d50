"""`megatron_config.manual_gc` (`workers/python_gc.py`): long-lived objects frozen before the first pass, no
automatic collection inside a pass, the pass's cyclic garbage freed when it ends."""

from __future__ import annotations

import gc
import weakref

import pytest

from skyrl_megatron.workers.python_gc import ManualGc


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def collector():
    """Collections recorded by generation; the collector's thresholds low, so a pass of a few
    thousand allocations would trigger collections of every generation; everything restored after."""
    thresholds, collections = gc.get_threshold(), []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.set_threshold(10, 2, 2)
    gc.callbacks.append(record)
    yield collections
    gc.callbacks.remove(record)
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    gc.enable()


def _a_pass() -> weakref.ref:
    garbage = _Node()
    for _ in range(3000):
        _Node()  # cyclic garbage, as autograd and module hooks make
    return weakref.ref(garbage)


def test_without_it_collections_start_inside_a_pass(collector):
    _a_pass()
    assert collector  # what the paused pass below must not see


def test_a_pass_sees_no_collection_and_leaves_no_cyclic_garbage(collector):
    manual = ManualGc()
    with manual.paused():
        assert gc.get_freeze_count() > 10_000  # the imports' objects, frozen before the pass
        collector.clear()
        garbage = _a_pass()
        assert collector == [] and garbage() is not None and not gc.isenabled()
    assert garbage() is None and gc.isenabled()  # collected when the pass ended
    made_between = _Node()
    with manual.paused():
        pass
    assert not _frozen(made_between)  # frozen once, not before every pass
    manual.freeze_again()  # after a checkpoint load
    with manual.paused():
        assert _frozen(made_between)


def _frozen(obj) -> bool:
    """In the permanent generation: tracked, yet not among the objects the collector walks."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_a_nested_pass_or_collection_turned_off_by_the_user_is_left_alone(collector):
    manual = ManualGc()
    gc.disable()
    with manual.paused():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("manual_gc", [True, False])
def test_the_workers_pass_guard_pauses_collection_when_configured(manual_gc, collector, stand_in_worker):
    worker = stand_in_worker({"manual_gc": manual_gc})
    with worker._step_guard("scoring"):
        assert gc.isenabled() is not manual_gc
