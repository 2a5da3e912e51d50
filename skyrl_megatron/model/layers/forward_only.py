"""Whether the current pass is forward-only: no backward follows it (scoring, the reference's logprobs).

Set by the forward-only schedule (`compute/schedule.forward_only`) around the whole pass. Grad mode alone cannot
tell: the first forward of a recomputed layer also runs without gradients, and must compute what its recomputation
will, so layers that change their arithmetic for scoring ask here instead.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_FORWARD_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("skyrl_megatron_forward_only", default=False)


@contextlib.contextmanager
def forward_only_pass() -> Iterator[None]:
    """Mark the pass inside as forward-only."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def active() -> bool:
    """Inside a forward-only pass, with gradients off."""
    return _FORWARD_ONLY.get() and not torch.is_grad_enabled()
