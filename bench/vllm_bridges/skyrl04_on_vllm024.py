"""Bench harness bridge: skyrl 0.4's vLLM servers and weight sync on vLLM 0.24 (not product code).

skyrl 0.4 pins vLLM 0.30 (torch 2.13); the GPU machines run vLLM 0.24.0, the release built for their torch (2.11).
What skyrl 0.4's server and weight-sync path needs from vLLM 0.30 and 0.24 lacks, each bridged here only when the
running vLLM lacks it (a vLLM that has a name keeps its own) and only once something imports the module concerned:

  vllm.distributed.weight_transfer.base        the trainer side of the transfer API: ParamMeta, WeightSource,
                                               materialize_full_tensor, TrainerInitInfo, VLLMWeightSyncClient,
                                               TrainerWeightTransferEngine
  ...weight_transfer.factory                   WeightTransferTrainerFactory (dispatch on the init info's backend)
  ...weight_transfer.nccl_engine               NCCLTrainerInitInfo / NCCLTrainerWeightTransferEngine over 0.24's
                                               static NCCLWeightTransferEngine.trainer_init / trainer_send_weights
                                               (0.24 sends the packed-buffer geometry with each update, 0.30 at
                                               the handshake)
  ...weight_transfer.ipc_engine                IPCTrainerInitInfo / IPCTrainerWeightTransferEngine over 0.24's
                                               IPCWeightTransferEngine.trainer_send_weights (handles gathered to
                                               global rank 0, which posts them)
  skyrl ... weight_sync.weight_receivers       the receive side: 0.24's worker owns start/finish and calls
                                               `receive_weights(info, load_weights=...)`, so skyrl's 0.30 engine
                                               subclasses cannot run; `skyrl_nccl` / `skyrl_ipc` receive with
                                               0.24's own engines (in-memory LoRA sync and FP8 hooks are lost)
  skyrl ... weight_sync.control_plane          `/start_weight_update` with a JSON body (0.24 answers 400 without)
  skyrl ... inference_servers.vllm_server_actor `create_server_socket(addr, reuse_port=...)` (0.24: one argument)

`vllm.entrypoints.launchers.cli_args` (0.30's home of FrontendArgs) is answered by `sitecustomize.py`'s module
aliases. Refused by skyrl's own checks or unusable here: the `delta` and `sharded_rdt` sync backends, the
speculative-decoding drafter sync. `install()` (called by `sitecustomize.py`) only registers the hooks.
"""

from __future__ import annotations

import abc
import importlib
import importlib.abc
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

_WEIGHT_TRANSFER = "vllm.distributed.weight_transfer"
_SKYRL_SYNC = "skyrl.backends.skyrl_train.weight_sync"


# -- the trainer side of vLLM 0.30's transfer API, on 0.24 -------------------------------------------------------

def _bridge_base(base) -> None:
    if hasattr(base, "WeightSource"):
        return
    import torch

    def materialize_full_tensor(tensor):
        full = getattr(tensor, "full_tensor", None)  # a DTensor's whole value
        return full() if callable(full) else tensor

    @dataclass(frozen=True)
    class ParamMeta:
        name: str
        dtype: torch.dtype
        shape: tuple

    class WeightSource(abc.ABC):
        """What a trainer sends: `metadata()` (names, dtypes, shapes) and the tensors in that order."""

        @abc.abstractmethod
        def metadata(self) -> list: ...

        @abc.abstractmethod
        def __iter__(self): ...

        def held_names(self):
            return None

    @dataclass
    class TrainerInitInfo:
        backend: ClassVar[str] = ""
        rank: int = field(kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    @runtime_checkable
    class VLLMWeightSyncClient(Protocol):
        def init_weight_transfer_engine(self, init_info: dict) -> None: ...
        def start_weight_update(self) -> None: ...
        def update_weights(self, update_info: dict) -> None: ...
        def finish_weight_update(self, weight_version=None) -> None: ...

    class TrainerWeightTransferEngine(abc.ABC):
        init_info_cls: type

        def __init__(self, *, client, source=None, is_sender: bool = True):
            self.client, self.source, self.is_sender = client, source, is_sender

        @classmethod
        @abc.abstractmethod
        def trainer_init(cls, init_info, *, client, source=None): ...

        @abc.abstractmethod
        def send_weights(self) -> None: ...

        def shutdown(self) -> None:
            pass

    for name, value in dict(materialize_full_tensor=materialize_full_tensor, ParamMeta=ParamMeta,
                            WeightSource=WeightSource, TrainerInitInfo=TrainerInitInfo,
                            VLLMWeightSyncClient=VLLMWeightSyncClient,
                            TrainerWeightTransferEngine=TrainerWeightTransferEngine).items():
        setattr(base, name, value)


def _bridge_factory(factory) -> None:
    if hasattr(factory, "WeightTransferTrainerFactory"):
        return

    class WeightTransferTrainerFactory:
        _registry: dict[str, Any] = {}

        @classmethod
        def register_engine(cls, name: str, module_or_class, class_name: str | None = None) -> None:
            if name in cls._registry:
                raise ValueError(f"trainer weight transfer engine {name!r} is already registered")
            if isinstance(module_or_class, str):
                cls._registry[name] = lambda: getattr(importlib.import_module(module_or_class), class_name)
            else:
                cls._registry[name] = lambda: module_or_class

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            if init_info.backend not in cls._registry:
                raise ValueError(f"no trainer weight transfer engine {init_info.backend!r}; registered: "
                                 f"{sorted(cls._registry)}")
            return cls._registry[init_info.backend]().trainer_init(init_info, client=client, source=source)

    factory.WeightTransferTrainerFactory = WeightTransferTrainerFactory
    WeightTransferTrainerFactory.register_engine("nccl", f"{_WEIGHT_TRANSFER}.nccl_engine",
                                                 "NCCLTrainerWeightTransferEngine")
    WeightTransferTrainerFactory.register_engine("ipc", f"{_WEIGHT_TRANSFER}.ipc_engine",
                                                 "IPCTrainerWeightTransferEngine")


def _update_info(metadata) -> dict:
    return {"names": [m.name for m in metadata], "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metadata],
            "shapes": [list(m.shape) for m in metadata]}


def _bridge_nccl(nccl) -> None:
    if hasattr(nccl, "NCCLTrainerWeightTransferEngine"):
        return
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    @dataclass
    class NCCLTrainerInitInfo(base.TrainerInitInfo):
        backend: ClassVar[str] = "nccl"
        master_address: str
        master_port: int
        world_size: int
        packed: bool = True
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    class NCCLTrainerWeightTransferEngine(base.TrainerWeightTransferEngine):
        """Rank 0 joins the inference workers' NCCL group and broadcasts; the other ranks only take part in
        the source's collectives."""

        init_info_cls = NCCLTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.info, engine.group = init_info, None
            if engine.is_sender:
                # 0.24's workers take exactly these keys (the client gives each server its rank offset)
                worker_init = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                               "rank_offset": 1, "world_size": init_info.world_size}
                with ThreadPoolExecutor(1) as pool:  # the workers join over HTTP while this rank joins here
                    joined = pool.submit(client.init_weight_transfer_engine, worker_init)
                    engine.group = nccl.NCCLWeightTransferEngine.trainer_init(worker_init)
                    joined.result()
            return engine

        def update_info(self, metadata) -> dict:
            return {**_update_info(metadata), "packed": self.info.packed,
                    "packed_buffer_size_bytes": self.info.packed_buffer_size_bytes,
                    "packed_num_buffers": self.info.packed_num_buffers}

        def send_weights(self) -> None:
            metadata = self.source.metadata()  # every rank: a source's metadata may be collective
            if not self.is_sender:
                for _ in self.source:
                    pass
                return
            self.client.start_weight_update()
            with ThreadPoolExecutor(1) as pool:  # the workers receive while this rank broadcasts
                received = pool.submit(self.client.update_weights, self.update_info(metadata))
                nccl.NCCLWeightTransferEngine.trainer_send_weights(iter(self.source), nccl.NCCLTrainerSendWeightsArgs(
                    group=self.group, packed=self.info.packed,
                    packed_buffer_size_bytes=self.info.packed_buffer_size_bytes,
                    packed_num_buffers=self.info.packed_num_buffers))
                received.result()
            self.client.finish_weight_update()

    nccl.NCCLTrainerInitInfo = NCCLTrainerInitInfo
    nccl.NCCLTrainerWeightTransferEngine = NCCLTrainerWeightTransferEngine


def _bridge_ipc(ipc) -> None:
    if hasattr(ipc, "IPCTrainerWeightTransferEngine"):
        return
    from vllm.distributed.weight_transfer import base
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    @dataclass
    class IPCTrainerInitInfo(base.TrainerInitInfo):
        backend: ClassVar[str] = "ipc"
        packed: bool = True
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    class IPCTrainerWeightTransferEngine(base.TrainerWeightTransferEngine):
        """Every rank packs its tensors into a shared buffer; vLLM gathers the handles to global rank 0,
        which posts each bucket and returns once the workers copied it."""

        init_info_cls = IPCTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.info = init_info
            if engine.is_sender:
                client.init_weight_transfer_engine({})  # 0.24's IPC init has no fields
            return engine

        def _post(self, update) -> None:
            self.client.update_weights({"names": update.names, "dtype_names": update.dtype_names,
                                        "shapes": update.shapes, "ipc_handles": update.ipc_handles,
                                        "tensor_sizes": update.tensor_sizes, "packed": update.packed})

        def send_weights(self) -> None:
            self.source.metadata()
            if self.is_sender:
                self.client.start_weight_update()
            ipc.IPCWeightTransferEngine.trainer_send_weights(iter(self.source), ipc.IPCTrainerSendWeightsArgs(
                send_mode=self._post, packed=self.info.packed,
                packed_buffer_size_bytes=self.info.packed_buffer_size_bytes))
            if self.is_sender:
                self.client.finish_weight_update()

    ipc.IPCTrainerInitInfo = IPCTrainerInitInfo
    ipc.IPCTrainerWeightTransferEngine = IPCTrainerWeightTransferEngine


# -- skyrl 0.4's side -----------------------------------------------------------------------------------------------

def _bridge_receivers(receivers) -> None:
    from vllm.distributed.weight_transfer import base

    if "load_weights" in _parameters(base.WeightTransferEngine.receive_weights):  # 0.24's worker-owned lifecycle
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        receivers._ENGINE_CACHE[receivers.SKYRL_NCCL_BACKEND] = NCCLWeightTransferEngine
        receivers._ENGINE_CACHE[receivers.SKYRL_IPC_BACKEND] = IPCWeightTransferEngine


def _bridge_control_plane(control_plane) -> None:
    def start_weight_update(self) -> None:  # 0.24's route parses a JSON body
        self._fanout_uniform(self._start_endpoint, {"is_checkpoint_format": True})

    control_plane.SkyrlWeightSyncClient.start_weight_update = start_weight_update


def _bridge_server_actor(actor) -> None:
    if "reuse_port" in _parameters(actor.create_server_socket):
        return

    def create_server_socket(address: tuple[str, int], reuse_port: bool = False) -> socket.socket:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family=family, type=socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        return sock

    actor.create_server_socket = create_server_socket


def _parameters(fn) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)


def _is_vllm_024() -> bool:
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm").startswith("0.24.")
    except importlib.metadata.PackageNotFoundError:
        return False


HOOKS = {
    f"{_WEIGHT_TRANSFER}.base": _bridge_base,
    f"{_WEIGHT_TRANSFER}.factory": _bridge_factory,
    f"{_WEIGHT_TRANSFER}.nccl_engine": _bridge_nccl,
    f"{_WEIGHT_TRANSFER}.ipc_engine": _bridge_ipc,
    f"{_SKYRL_SYNC}.weight_receivers": _bridge_receivers,
    f"{_SKYRL_SYNC}.control_plane": _bridge_control_plane,
    "skyrl.backends.skyrl_train.inference_servers.vllm_server_actor": _bridge_server_actor,
}


def spec_elsewhere(finder, name, path=None, target=None):
    """The spec the import system's other finders give `name` (None: the module does not exist)."""
    for other in sys.meta_path:
        if other is not finder and hasattr(other, "find_spec"):
            spec = other.find_spec(name, path, target)
            if spec is not None:
                return spec
    return None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `HOOKS[name](module)` right after the module `name` is executed, before anyone uses it."""

    def find_spec(self, name, path=None, target=None):
        if name not in HOOKS:
            return None
        spec = spec_elsewhere(self, name, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, HOOKS[name])
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._hook(module)


def install() -> None:
    """Register the hooks where vLLM 0.24 is installed (cheap: nothing is imported); modules already imported
    are bridged now."""
    if any(isinstance(finder, _AfterImport) for finder in sys.meta_path) or not _is_vllm_024():
        return
    sys.meta_path.insert(0, _AfterImport())
    for name, hook in HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
