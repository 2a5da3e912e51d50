"""The offloader's host buffers: kept per device storage from one offload to the next (pinning is the slow
part of an offload on GPUs), refreshed with the current values at every offload, and replaced where a storage
no longer fits its buffer. On CPU the buffers are not pinned; `keep_host_buffers=True` keeps them as a GPU run
does (by default the CPU runtime does not keep them: its device memory is host memory)."""

from __future__ import annotations

import torch

from skyrl_megatron.workers.offload import ModelOffloader


def _adam(*shapes: tuple[int, ...]) -> tuple[torch.optim.Adam, list[torch.Tensor]]:
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # the moments exist from the first step on
    return optimizer, params


def _state(optimizer: torch.optim.Adam) -> list[torch.Tensor]:
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors.append(p.detach().clone())
            tensors += [v.clone() for v in optimizer.state[p].values() if v.dim() > 0]
    return tensors


def _round_trip(offloader: ModelOffloader, optimizer) -> list[torch.Tensor]:
    """Offload and backload the optimizer state; returns the host buffers it was parked in."""
    offloader.offload(model=False, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
    hosts = [parked.host for parked in offloader._parked["optimizer"]]
    assert all(p.untyped_storage().nbytes() == 0 for p in optimizer.param_groups[0]["params"])
    offloader.backload(model=False, optimizer=True, optimizer_obj=optimizer)
    return hosts


def test_kept_host_buffers_are_reused_and_carry_the_current_values():
    optimizer, params = _adam((64, 32), (128,), (7, 3))
    offloader = ModelOffloader([], keep_host_buffers=True)
    first = _round_trip(offloader, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_state(optimizer), [h for h in first]))
    # training moves the state on; the next offload writes the new values into the same buffers
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    expected = _state(optimizer)
    second = _round_trip(offloader, optimizer)
    assert [h.data_ptr() for h in second] == [h.data_ptr() for h in first]
    assert all(torch.equal(h, e) for h, e in zip(second, expected))
    assert all(torch.equal(a, e) for a, e in zip(_state(optimizer), expected))  # and back, bitwise


def test_a_storage_that_no_longer_fits_its_buffer_gets_a_new_one():
    optimizer, params = _adam((16, 16), (8,))
    offloader = ModelOffloader([], keep_host_buffers=True)
    first = _round_trip(offloader, optimizer)
    params[0].data = torch.randn(4, 4)  # (a new storage: parked in a buffer of its own)
    optimizer.state[params[0]]["exp_avg"] = torch.zeros(4, 4)
    optimizer.state[params[0]]["exp_avg_sq"] = torch.zeros(4, 4)
    expected = _state(optimizer)
    second = _round_trip(offloader, optimizer)
    assert second[0].shape == (4, 4) and second[0].data_ptr() != first[0].data_ptr()
    assert second[-1].data_ptr() == first[-1].data_ptr()  # the untouched parameter's moment keeps its buffer
    assert all(torch.equal(a, e) for a, e in zip(_state(optimizer), expected))


def test_the_cpu_runtime_keeps_no_host_copy_between_offloads():
    optimizer, _ = _adam((32, 8))
    offloader = ModelOffloader([])
    _round_trip(offloader, optimizer)
    assert len(offloader._host_buffers) == 0
