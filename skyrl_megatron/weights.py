"""Stream a Megatron model's weights out as full Hugging Face tensors, with bounded memory.

Weight sync to inference engines and HF saving both need the model under HF names, one full tensor per
HF parameter, while each rank holds only its tensor / pipeline / expert shards. Megatron-Bridge's
``export_hf_weights`` does the gathering one Megatron parameter at a time: a broadcast from the pipeline
stage that owns the parameter, an all-gather over its tensor-parallel group and, for experts, over its
expert-parallel group. Every rank takes part in every gather and receives every full tensor, so:

* every rank of the model must drain the stream to the end (stopping early leaves peers in a collective);
* nothing here accumulates a model copy: :func:`iter_hf_weights` holds one exported tensor at a time,
  :func:`iter_weight_buckets` at most one bucket plus the tensor that did not fit into it.

Tensors come out where the gathers ran (the model's device) unless `device` says otherwise, cast to
`dtype` when given. They may share memory with the model's parameters (a replicated weight is passed
through without a copy): consume them before the next optimizer step, or copy them.

Each stream carries an :class:`ExportReport` that fills in as it is iterated.

A model with LoRA adapters exports merged weights (base + scale * BA, under the base's HF names): what an
inference engine without LoRA support serves. The adapters (rank r of each adapted matrix: small) are
gathered once at the start and held through the stream. :func:`iter_peft_adapter_weights` exports the
adapters alone, under the names of HF `peft`'s `adapter_model.safetensors`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from skyrl_megatron.model.adapters.lora import AdapterMerger, PeftAdapter

if TYPE_CHECKING:
    from skyrl_megatron.model.build import BuiltModel

T = TypeVar("T")


@dataclass
class ExportReport:
    """What one export moved and what it cost; complete once its stream is exhausted."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0  # stays 0 for an unbucketed stream
    largest_tensor_bytes: int = 0
    # The most bytes of exported tensors the exporter itself referenced at one time: one tensor for
    # iter_hf_weights; the pending bucket plus the tensor in hand for iter_weight_buckets, which is at
    # most bucket_bytes + largest_tensor_bytes. What the consumer keeps is the consumer's business.
    peak_held_bytes: int = 0
    # Time spent inside the exporter (gathers, conversion, cast, copy); the consumer's time between
    # items is not counted. On CUDA, kernels still in flight when an item is handed over are not either.
    seconds: float = 0.0

    def _record_tensor(self, tensor: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes += tensor.nbytes
        self.largest_tensor_bytes = max(self.largest_tensor_bytes, tensor.nbytes)
        self._record_held(tensor.nbytes)

    def _record_held(self, nbytes: int) -> None:
        self.peak_held_bytes = max(self.peak_held_bytes, nbytes)


class WeightStream(Iterator[T], Generic[T]):
    """An export in progress: an iterator with the :class:`ExportReport` it fills in."""

    def __init__(self, items: Iterator[T], report: ExportReport):
        self._items = items
        self.report = report

    def __iter__(self) -> WeightStream[T]:
        return self

    def __next__(self) -> T:
        return next(self._items)


@dataclass(frozen=True)
class WeightBucket:
    """Full HF tensors to be sent together, with their metadata.

    Field for field the host's ``skyrl_train.weight_sync.WeightChunk`` (dtypes spelled ``str(torch.dtype)``,
    e.g. ``"torch.bfloat16"``, shapes as lists of ints); :func:`skyrl_megatron.host_api.weight_chunk` converts.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[torch.Tensor]

    @classmethod
    def of(cls, names: list[str], tensors: list[torch.Tensor]) -> WeightBucket:
        return cls(
            names=list(names),
            dtypes=[str(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            tensors=list(tensors),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __len__(self) -> int:
        return len(self.names)


def iter_hf_weights(
    built: BuiltModel,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    value_head_name: str = "value_head.weight",
) -> WeightStream[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs for the whole model, one at a time. Collective: all ranks iterate.

    `dtype` casts floating-point tensors (e.g. bf16 for vLLM); `device` moves them (e.g. "cpu" to save),
    after the cast so that a down-cast crosses the bus at its smaller size. Tensors are contiguous.
    """
    report = ExportReport()
    return WeightStream(_export(built, dtype, device, report, value_head_name), report)


def iter_peft_adapter_weights(
    built: BuiltModel,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> WeightStream[tuple[str, torch.Tensor]]:
    """The LoRA adapters alone, as (name in HF `peft`'s adapter file, full tensor). Collective.

    Unlike the base weights, the adapters are gathered all at once before the first item: the PEFT
    layout packs MoE expert adapters from several exported tensors, and adapters are small (rank r of
    every adapted matrix). `peak_held_bytes` therefore counts all of them.
    """
    report = ExportReport()
    return WeightStream(_export_adapters(built, dtype, device, report), report)


def iter_weight_buckets(
    built: BuiltModel,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    adapters_only: bool = False,
) -> WeightStream[WeightBucket]:
    """The model's HF tensors grouped into :class:`WeightBucket` s of at most `bucket_bytes` each.

    Buckets keep the export order. A tensor larger than `bucket_bytes` travels in a bucket of its own, so
    no bucket exceeds ``max(bucket_bytes, largest tensor)``. With `adapters_only` the buckets carry
    :func:`iter_peft_adapter_weights` instead of the (merged) model. Collective: all ranks iterate.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    stream = iter_peft_adapter_weights if adapters_only else iter_hf_weights
    weights = stream(built, dtype=dtype, device=device)
    return WeightStream(_bucketed(weights, bucket_bytes, weights.report), weights.report)


# the HF name Megatron-Bridge gives the output layer of the architectures it converts
_LM_HEAD_NAME = "lm_head.weight"


def _export(
    built: BuiltModel,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    report: ExportReport,
    value_head_name: str = "value_head.weight",
) -> Iterator[tuple[str, torch.Tensor]]:
    started = time.perf_counter()
    with torch.no_grad():
        # LoRA: the adapters (small) are gathered up front and folded into their base weights as those
        # stream past; the bridge's own merge is wrong under expert parallelism (see AdapterMerger).
        merge = AdapterMerger.for_model(built) if built.lora is not None else None
    report.seconds += time.perf_counter() - started
    head_seen = False
    # cpu=False: gather on the model's device and let `device` decide where the result goes, so the GPU
    # path (CUDA IPC, NCCL broadcast) never round-trips through host memory.
    bridge_items = iter(
        built.bridge.export_hf_weights(built.chunks, cpu=False, show_progress=False, merge_adapter_weights=False)
    )
    while True:
        started = time.perf_counter()
        # Grad mode is thread state: switch it off around each step of the bridge's generator only, never
        # across a yield, so the consumer's code keeps its own. The gathers then record no autograd graph.
        with torch.no_grad():
            item = next(bridge_items, None)
            if item is None:
                if merge is not None:
                    merge.check_all_merged()
                if built.value_head and not head_seen:
                    raise RuntimeError(
                        f"the critic's value head was not exported: Megatron-Bridge yielded no {_LM_HEAD_NAME!r} "
                        "for this architecture"
                    )
                return
            name, tensor = item
            if built.value_head and name == _LM_HEAD_NAME:
                # a critic (model/adapters/value_head.py): its [1, hidden] head stands where the LM head was
                name, head_seen = value_head_name, True
            if merge is not None:
                name, tensor = merge(name, tensor)
            tensor = _convert(tensor, dtype, device)
        report.seconds += time.perf_counter() - started
        report._record_tensor(tensor)
        yield name, tensor
        # Drop this frame's references before the bridge gathers the next tensor: otherwise the
        # previous tensor would stay alive through that gather, outside the consumer's control.
        del item, tensor


def _export_adapters(
    built: BuiltModel, dtype: torch.dtype | None, device: torch.device | str | None, report: ExportReport
) -> Iterator[tuple[str, torch.Tensor]]:
    started = time.perf_counter()
    with torch.no_grad():
        adapter = PeftAdapter.export(built)
        state = {name: _convert(tensor, dtype, device) for name, tensor in adapter.state.items()}
    del adapter
    report.seconds += time.perf_counter() - started
    for tensor in state.values():
        report._record_tensor(tensor)
    report._record_held(sum(tensor.nbytes for tensor in state.values()))
    while state:
        name = next(iter(state))
        yield name, state.pop(name)


def _convert(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if device is not None:
        tensor = tensor.to(device)
    # Transfer strategies (CUDA IPC, NCCL broadcast) and safetensors need dense storage; split Q/K/V or
    # gate/up halves can come out as strided views.
    return tensor.contiguous()


def _bucketed(
    weights: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, report: ExportReport
) -> Iterator[WeightBucket]:
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    pending_bytes = 0
    for name, tensor in weights:
        if tensors and pending_bytes + tensor.nbytes > bucket_bytes:
            # The size of the next tensor is known only once it is gathered, so an overflowing tensor is
            # in hand while the pending bucket goes out: the one moment the exporter holds more than a bucket.
            report._record_held(pending_bytes + tensor.nbytes)
            report.buckets += 1
            yield WeightBucket.of(names, tensors)
            names, tensors, pending_bytes = [], [], 0
        names.append(name)
        tensors.append(tensor)
        pending_bytes += tensor.nbytes
        report._record_held(pending_bytes)
        del tensor  # the bucket owns it now
        if pending_bytes >= bucket_bytes:
            # Full (or one oversized tensor): send it now rather than holding it through the next gather.
            report.buckets += 1
            yield WeightBucket.of(names, tensors)
            names, tensors, pending_bytes = [], [], 0
    if tensors:
        report.buckets += 1
        yield WeightBucket.of(names, tensors)
