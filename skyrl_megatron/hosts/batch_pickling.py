"""Batches that pickle once, through out-of-band buffers.

skyrl-train 0.3.1's `TensorBatch` (a dict of CPU tensors plus metadata) reaches every worker through
Ray's pickle, and pays twice there: its ``__getstate__`` writes each field with ``torch.save`` into a
``bytes`` object, and, being a dict subclass, pickle also writes its items a second time as tensors
(the ``dictitems`` of protocol 2 and above); the receiver loads both. Here a batch reduces to one
array per field, which pickle protocol 5 (Ray's) hands over as out-of-band buffers, and is rebuilt by
its own constructor. The receiver copies each buffer once: Ray's buffers are read-only views of its
object store, and the batch's tensors are the receiver's to change.

The reduction names :func:`rebuild_batch` by reference: whoever unpickles such a batch needs this
package importable (every process of a run that activated skyrl-megatron has it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_BATCH_FIELDS = "_skyrl_megatron_batch_fields"


def _as_bytes(name: str, tensor: torch.Tensor):
    """A CPU tensor as (dtype, shape, uint8 array of its contiguous bytes): every dtype numpy lacks
    (bf16, the float8s) travels as its bytes and is viewed back."""
    import torch  # not at import: the adapter importing this module runs in every Ray process's start-up

    if tensor.device.type != "cpu":
        raise ValueError(f"batch field {name!r} is on {tensor.device}: move the batch to the CPU before sending it")
    flat = tensor.detach().contiguous().reshape(-1)
    return tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy()


def _from_bytes(dtype: torch.dtype, shape: tuple[int, ...], data) -> torch.Tensor:
    import torch

    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(data.copy()).view(dtype).view(shape)


def reduce_batch(batch) -> tuple:
    """`__reduce__` for a dict-of-tensors batch class with a ``metadata`` attribute."""
    fields = {name: None if value is None else _as_bytes(name, value) for name, value in dict.items(batch)}
    return rebuild_batch, (type(batch), fields, batch.metadata)


def rebuild_batch(cls, fields: dict[str, Any], metadata):
    batch = cls({name: None if packed is None else _from_bytes(*packed) for name, packed in fields.items()})
    batch.metadata = metadata
    return batch


def pickle_batches_once(batch_class) -> None:
    """Give `batch_class` (and its subclasses) the reduction above. Idempotent."""
    if getattr(batch_class, _BATCH_FIELDS, False):
        return
    batch_class.__reduce__ = reduce_batch
    setattr(batch_class, _BATCH_FIELDS, True)
