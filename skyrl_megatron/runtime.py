"""Device runtime: CUDA (NCCL) in production, or CPU (gloo) for laptops and CI.

Megatron-Core 0.19 assumes CUDA in a few hundred places: `device="cuda"` buffers,
`torch.cuda.current_device()`, CUDA streams/events, `tensor.type() == "torch.cuda.FloatTensor"`
checks. The CPU mode redirects those in one place so the *same* worker code runs on both devices:

* a process-wide :class:`torch.overrides.TorchFunctionMode` rewrites CUDA device arguments (strings,
  `torch.device`, and bare integers, which torch reads as CUDA ordinals) to CPU, makes
  `Tensor.cuda()` / `pin_memory()` identities, and answers `Tensor.type()` with the CUDA type name
  that Megatron's optimizer and grad-clip code check for;
* `torch.cuda` stream, event, synchronize and device-query functions become CPU stand-ins
  (streams and events must stay *classes*: Megatron uses them in annotations and `isinstance`).

Select with :func:`activate_runtime` ("auto" picks CUDA when a GPU is visible).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

RUNTIME_ENV_VAR = "SKYRL_MEGATRON_RUNTIME"

# Megatron-Core 0.19.2's inference/contexts/kv_block_allocator.py has a docstring with an invalid escape
# ('\-'): Python warns when it compiles that file, i.e. on the first import after an install without
# bytecode (the GPU machines install with --no-compile). Inference code we never run; the filter names that
# one file, so any other SyntaxWarning still shows. Set here: every process that builds a model imports us
# before Megatron.
warnings.filterwarnings(
    "ignore", category=SyntaxWarning, module=r".*megatron[/\\]core[/\\]inference[/\\]contexts[/\\]kv_block_allocator"
)


class Device(str, Enum):
    CUDA = "cuda"
    CPU = "cpu"


@dataclass(frozen=True)
class Runtime:
    """What the workers need to know about the device they run on."""

    device: Device

    @property
    def backend(self) -> str:
        return "nccl" if self.device is Device.CUDA else "gloo"

    @property
    def torch_device(self) -> torch.device:
        if self.device is Device.CUDA:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_cpu(self) -> bool:
        return self.device is Device.CPU

    def transformer_config_overrides(self) -> dict[str, Any]:
        """TransformerConfig settings this device needs: Megatron's fused kernels are CUDA-only."""
        if self.device is Device.CUDA:
            return {}
        return dict(
            use_cpu_initialization=True,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            moe_permute_fusion=False,
            # Gloo runs a batch_isend_irecv as independent sends and receives; under the interleaved
            # (VPP) training schedule they then pair up with the wrong micro-batch's activations.
            batch_p2p_comm=False,
        )


_ACTIVE: Runtime | None = None


def resolve_device(requested: str | None = None) -> Device:
    """Map a config/env value ("auto", "cuda", "cpu") to a device.

    The environment variable wins over the config so an operator can force CPU for debugging.
    """
    value = (os.environ.get(RUNTIME_ENV_VAR) or requested or "auto").lower()
    if value == "auto":
        return Device.CUDA if torch.cuda.is_available() else Device.CPU
    try:
        device = Device(value)
    except ValueError:
        raise ValueError(
            f"runtime device {value!r} is not one of 'auto', 'cuda', 'cpu' "
            f"(set megatron_config.runtime or ${RUNTIME_ENV_VAR})"
        ) from None
    if device is Device.CUDA and not torch.cuda.is_available():
        raise RuntimeError(
            "runtime 'cuda' was requested but torch sees no GPU; use runtime=auto or cpu to run on CPU"
        )
    return device


def activate_runtime(requested: str | None = None) -> Runtime:
    """Choose the device for this process and, for CPU, install the CUDA redirects. Idempotent."""
    global _ACTIVE
    device = resolve_device(requested)
    if _ACTIVE is not None:
        if _ACTIVE.device is not device:
            raise RuntimeError(f"runtime already active as {_ACTIVE.device.value}; cannot switch to {device.value}")
        return _ACTIVE
    if device is Device.CPU:
        _install_cpu_redirects()
        logger.info("skyrl-megatron runtime: CPU (gloo); Megatron's CUDA calls are redirected to CPU")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
        torch.set_num_threads(gpu_worker_host_threads(os.environ))
    _ACTIVE = Runtime(device)
    return _ACTIVE


def gpu_worker_host_threads(env: Mapping[str, str]) -> int:
    """Intra-op threads for a GPU worker's tensor work on the host (packing micro-batches,
    collecting results): small tensors, where a thread pool only adds the cost of waking it, and
    a pool per GPU worker on one host oversubscribes its cores. `OMP_NUM_THREADS` where set (Ray
    sets it to the CPUs an actor was given, PyTorch may have read it before), else one."""
    try:
        return max(1, int(env.get("OMP_NUM_THREADS") or 1))
    except ValueError:
        return 1


@contextlib.contextmanager
def quiet_megatron_import():
    """Silence the import-time notices Megatron prints when TE/Apex are absent (we report our own choice)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        yield


def current_runtime() -> Runtime:
    if _ACTIVE is None:
        return activate_runtime()
    return _ACTIVE


# ----------------------------------------------------------------------------------------------
# CPU redirects
# ----------------------------------------------------------------------------------------------

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _to_cpu_device(value: Any) -> Any:
    if isinstance(value, torch.device):
        return torch.device("cpu") if value.type == "cuda" else value
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):
        # torch reads a bare int device as a CUDA ordinal
        return "cpu"
    return value


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while it is on the mode stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False

        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            return _CUDA_TYPE_NAMES.get(tensor.dtype, func(*args))
        if func is torch.Tensor.to and args:
            # positional device arguments: strings, torch.device, and bare CUDA ordinals (not bools);
            # only `to` takes them positionally (`new_zeros(3)` is a size, not a device)
            args = (args[0],) + tuple(_to_cpu_device(a) for a in args[1:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for `torch.cuda.Stream`: work on CPU is already ordered, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    """Stand-in for `torch.cuda.Event`; timings come from wall clock where Megatron asks for them."""

    def __init__(self, *args, **kwargs):
        self._time = 0.0

    def record(self, *args, **kwargs):
        import time

        self._time = time.perf_counter()

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._time - self._time) * 1000.0


_CPU_MODE: _CudaToCpuMode | None = None


def _install_cpu_redirects() -> None:
    global _CPU_MODE
    if _CPU_MODE is not None:
        return
    cuda = torch.cuda
    _default_stream = _CpuStream()
    replacements = {
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Stream": _CpuStream,
        "Event": _CpuEvent,
        "current_stream": lambda *a, **k: _default_stream,
        "default_stream": lambda *a, **k: _default_stream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
    }
    for name, value in replacements.items():
        setattr(cuda, name, value)
    cuda.memory.empty_cache = replacements["empty_cache"]
    # Megatron's RNG tracker reads/writes the CUDA generator; on CPU the CPU generator plays that role.
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None

    _CPU_MODE = _CudaToCpuMode()
    _CPU_MODE.__enter__()  # stays on the mode stack for the life of the process
    _redirect_in_custom_backward()
    _allow_uneven_all_gather_on_gloo()
    _patch_megatron_for_cpu()


def _redirect_in_custom_backward() -> None:
    """The autograd engine runs custom `Function.backward`s without the Python mode stack, and
    Megatron's TP/SP backward passes allocate CUDA buffers there: re-enter the mode for them."""
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply

    def apply(self, *args):
        if torch._C._len_torch_function_stack() == 0:
            with _CudaToCpuMode():
                return original(self, *args)
        return original(self, *args)

    BackwardCFunction.apply = apply


def _allow_uneven_all_gather_on_gloo() -> None:
    """gloo's all_gather needs equal sizes; NCCL's does not, and Megatron's MoE dispatch relies on it
    (tokens per rank differ). Pad to the largest first dimension, gather, and copy the slices out."""
    import torch.distributed as dist

    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = {t.shape[0] for t in tensor_list} | {tensor.shape[0]}
        if len(sizes) == 1 or async_op or tensor.dim() == 0:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = [torch.empty((longest, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensor_list]
        source = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        source[: tensor.shape[0]] = tensor
        original(padded, source, group=group)
        for out, full in zip(tensor_list, padded):
            out.copy_(full[: out.shape[0]])
        return None

    dist.all_gather = all_gather


def _patch_megatron_for_cpu() -> None:
    """Megatron code paths whose CPU behaviour differs from CUDA in ways the mode cannot see."""
    with quiet_megatron_import():
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        # On CUDA the MoE split sizes come back as numpy arrays; on CPU the original returns the
        # tensor unchanged, and all_to_all then rejects tensor split sizes.
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # Activation recompute saves and restores "CUDA" RNG states around each checkpointed block. On
    # CPU every random draw comes from the CPU generator, which Megatron saves and restores beside
    # it, so the device state is a placeholder that restoring must not touch.
    with quiet_megatron_import():
        from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
