"""0.3.1's batches cross Ray's pickle once, through out-of-band buffers, and come back equal."""

from __future__ import annotations

import pickle

import pytest
import torch

from skyrl_megatron.hosts.batch_pickling import pickle_batches_once

training_batch = pytest.importorskip("skyrl_train.training_batch")


class _Batch(training_batch.TrainingInputBatch):
    """A subclass of the host's batch carrying the fix, so this module's tests leave the host's class as it is."""


pickle_batches_once(_Batch)


class _HostPickled(training_batch.TrainingInputBatch):
    """The host's batch as 0.3.1 pickles it (whether or not activation fixed the host's class in this process)."""

    __reduce__ = object.__reduce__


def _fields(rows: int = 3) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(rows, 40, generator=generator)
    return {
        "sequences": torch.randint(0, 50_000, (rows, 24), generator=generator),
        "attention_mask": torch.rand(rows, 24, generator=generator) > 0.3,
        "advantages": torch.randn(rows, 16, generator=generator),
        "rollout_logprobs": torch.randn(rows, 16, generator=generator).bfloat16(),
        "old_values": torch.randn(rows, 16, generator=generator).half(),
        "bytes": torch.randint(0, 255, (rows, 5), dtype=torch.uint8, generator=generator),
        "strided": wide[:, ::2],  # a view: the batch sends its values, not its storage
        "empty": torch.zeros(rows, 0),
        "routes": torch.randint(0, 8, (rows, 16, 2, 2), dtype=torch.int32, generator=generator),
        "values": None,
    }


def _batch(cls, rows: int = 3):
    batch = cls(_fields(rows))
    batch.metadata = {"response_length": 16, "uids": ["a", "b", "c"]}
    return batch


def _round_trip(batch):
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers), data, buffers


def test_every_field_comes_back_equal_in_dtype_shape_and_value():
    sent = _batch(_Batch)
    got, _, _ = _round_trip(sent)
    assert type(got) is _Batch and got.metadata == sent.metadata and len(got) == len(sent)
    assert list(got.keys()) == list(sent.keys())
    for name, value in sent.items():
        if value is None:
            assert got[name] is None
            continue
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def test_each_tensor_travels_once_out_of_band_where_the_hosts_own_pickle_sends_it_twice():
    sent = _batch(_Batch, rows=64)
    tensor_bytes = sum(v.numel() * v.element_size() for v in sent.values() if v is not None)
    _, in_band, buffers = _round_trip(sent)
    assert sum(memoryview(b).nbytes for b in buffers) == tensor_bytes
    assert len(in_band) < 4096  # field names, dtypes, shapes, metadata
    host_bytes = len(pickle.dumps(_batch(_HostPickled, rows=64), protocol=5))
    assert host_bytes > 2 * tensor_bytes  # the premise of the fix: torch.save's copy plus the dict items


def test_the_received_tensors_are_the_receivers_own_memory():
    sent = _batch(_Batch)
    got, _, _ = _round_trip(sent)
    before = sent["advantages"].clone()
    got["advantages"].add_(1.0)  # Ray's buffers are read-only views of its store: the batch must not be one
    assert torch.equal(sent["advantages"], before)


def test_a_field_off_the_cpu_is_named_before_anything_is_sent():
    batch = _Batch({"sequences": torch.zeros(2, 4, dtype=torch.long)})
    batch["logprobs"] = torch.empty(2, 4, device="meta")
    with pytest.raises(ValueError, match="'logprobs' is on meta"):
        pickle.dumps(batch, protocol=5)


def test_the_hosts_split_and_concatenation_still_work_on_received_batches():
    got, _, _ = _round_trip(_batch(_Batch, rows=4))
    halves = got.chunk(2)
    assert [len(h) for h in halves] == [2, 2]
    joined = _Batch.cat(halves)
    assert torch.equal(joined["sequences"], got["sequences"])
