"""State on its way back to the accelerator: copies issued on a side stream that its first reader waits for.

A colocated run brings the optimizer's state back from host memory before training (`workers/offload.py`); it is
first needed at the optimizer step, after the first micro-batches' forward and backward, so its copies run on a
stream of their own beside them. Whoever touches that state first calls :func:`settle` with its owner (the
optimizer): the current stream then waits for the copies. The lookups every reader goes through call it
(`optim.torch_optimizers`, `optim.optimizer_step`, `master_weights.compact_masters_of`), so no reader can see the
state before it has arrived.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

_PENDING: "weakref.WeakKeyDictionary[object, Callable[[], None]]" = weakref.WeakKeyDictionary()


def expect(owner: object, wait: Callable[[], None]) -> None:
    """`owner`'s state is arriving; `wait()` makes the current stream wait for it (called once, by `settle`)."""
    earlier = _PENDING.pop(owner, None)
    if earlier is not None:
        earlier()
    _PENDING[owner] = wait


def settle(owner: object | None) -> None:
    """Make the current stream wait for `owner`'s arriving state; nothing when none is in flight."""
    if owner is None:
        return
    wait = _PENDING.pop(owner, None)
    if wait is not None:
        wait()


def arriving(owner: object) -> bool:
    return owner in _PENDING
