"""The bench bridge for skyrl 0.4's vLLM servers on vLLM 0.24 (`bench/vllm_bridges/skyrl04_on_vllm024.py`), on CPU
against the real vLLM 0.24 and skyrl 0.4: everything imports through the bridge (our own weight source too), the
trainer engines skyrl builds send in the order vLLM 0.24's workers expect, and what they post is what 0.24's own
engines parse. The transfers themselves (NCCL, CUDA IPC) are recorded here, not run: they need GPUs.

Each check runs in a fresh interpreter with the bridge folder first on PYTHONPATH, as on the GPU machines, so
`sitecustomize` installs it at start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("skyrl.backends.skyrl_train.weight_sync", reason="the skyrl 0.4 environment")

PRELUDE = r'''
import json, os, socket, sys, types, warnings
warnings.filterwarnings("ignore")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # as skyrl's server actor sets it: pickled IPC handles
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from skyrl.backends.skyrl_train.weight_sync import register, weight_senders
from skyrl.backends.skyrl_train.weight_sync.control_plane import _json_safe, nccl_init_payloads

class Recorder:
    def __init__(self): self.calls = []
    def init_weight_transfer_engine(self, info): self.calls.append(["init", info])
    def start_weight_update(self): self.calls.append(["start"])
    def update_weights(self, info): self.calls.append(["update", _json_safe(info)])
    def finish_weight_update(self, weight_version=None): self.calls.append(["finish"])

class Source(WeightSource):
    def __init__(self): self.tensors = {"a.weight": torch.ones(2, 3, dtype=torch.bfloat16), "b.bias": torch.zeros(4, dtype=torch.bfloat16)}; self.iterated = 0
    def metadata(self): return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]
    def __iter__(self):
        for item in self.tensors.items(): self.iterated += 1; yield item

register.register_trainer_engines()
out = {}
'''

NCCL = r'''
sent = {}
NCCLWeightTransferEngine.trainer_init = staticmethod(lambda init: sent.setdefault("joined", dict(init)) and "group")
def broadcast(iterator, args):
    sent["names"] = [name for name, _ in iterator]
    sent["args"] = {"group": args.group, "packed": args.packed, "buffer": args.packed_buffer_size_bytes}
NCCLWeightTransferEngine.trainer_send_weights = staticmethod(broadcast)
info_cls, engine_cls = weight_senders.get_skyrl_nccl_trainer()
for rank in (0, 1):
    client, source = Recorder(), Source()
    info = info_cls(master_address="10.0.0.1", master_port=29555, world_size=3, packed=True,
                    packed_buffer_size_bytes=1 << 20, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights()
    out[f"rank{rank}"] = {"calls": [c[0] for c in client.calls], "iterated": source.iterated,
                          "skyrl_engine": isinstance(engine, engine_cls)}
    if rank == 0:
        receiver = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)
        init = client.calls[0][1]
        out["per_server"] = [vars(receiver.parse_init_info(p)) for p in nccl_init_payloads(init, ["u1", "u2"], 1)]
        update = receiver.parse_update_info(client.calls[2][1])
        out["update"] = {"names": update.names, "dtypes": update.dtype_names, "shapes": update.shapes,
                         "packed": update.packed, "buffer": update.packed_buffer_size_bytes}
out["sent"] = sent
print(json.dumps(out, default=str))
'''

IPC = r'''
def pack_and_gather(iterator, args):  # vLLM packs the tensors into an IPC buffer and calls send_mode on rank 0
    names = []
    for name, tensor in iterator: names.append((name, tensor.dtype, list(tensor.shape)))
    update = types.SimpleNamespace(names=[n for n, _, _ in names], dtype_names=[str(d).removeprefix("torch.") for _, d, _ in names],
                                   shapes=[s for _, _, s in names], ipc_handles=[{"GPU-0": ("handle", 1)}],
                                   tensor_sizes=[28], packed=args.packed)
    args.send_mode(update)
IPCWeightTransferEngine.trainer_send_weights = staticmethod(pack_and_gather)
info_cls, engine_cls = weight_senders.get_skyrl_ipc_trainer()
client, source = Recorder(), Source()
engine = WeightTransferTrainerFactory.trainer_init(info_cls(packed=True, packed_buffer_size_bytes=1 << 20, rank=0),
                                                    client=client, source=source)
engine.send_weights()
receiver = IPCWeightTransferEngine.__new__(IPCWeightTransferEngine)
out["calls"] = [c[0] for c in client.calls]
out["init"] = vars(receiver.parse_init_info(client.calls[0][1]))
update = receiver.parse_update_info(client.calls[2][1])
out["update"] = {"names": update.names, "shapes": update.shapes, "packed": update.packed, "handles": update.ipc_handles}
out["skyrl_engine"] = isinstance(engine, engine_cls)
print(json.dumps(out, default=str))
'''

SERVER_SIDE = r'''
from vllm.entrypoints.launchers.cli_args import FrontendArgs, make_arg_parser
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from skyrl.backends.skyrl_train.inference_servers import utils, vllm_server_actor
from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
from skyrl_megatron.workers import vllm_source  # ours: vLLM 0.30's WeightSource, answered by the bridge
register.register_receive_engines()
out["receivers"] = {k: WeightTransferEngineFactory._registry[k]().__qualname__ for k in ("skyrl_nccl", "skyrl_ipc")}
posted = []
client = SkyrlWeightSyncClient.__new__(SkyrlWeightSyncClient)
client._start_endpoint = "/start_weight_update"
client._fanout_uniform = lambda endpoint, body: posted.append([endpoint, body])
client.start_weight_update()
out["start_body"] = posted
sock = vllm_server_actor.create_server_socket(("127.0.0.1", 0), reuse_port=False)
out["bound"] = sock.getsockname()[1] > 0
out["reuse_port"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
sock.close()
out["frontend_args"] = FrontendArgs.__module__
print(json.dumps(out, default=str))
'''


def _run(script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "vllm_bridges"), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True, text=True, env=env,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_nccl_sender_joins_and_broadcasts_in_the_order_vllm_024_expects():
    out = _run(NCCL)
    # rank 0 joins the group while the servers are told to, then start -> update (beside the broadcast) -> finish
    assert out["rank0"]["calls"] == ["init", "start", "update", "finish"] and out["rank0"]["skyrl_engine"]
    assert out["sent"]["joined"] == {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1,
                                     "world_size": 3}
    assert out["sent"]["names"] == ["a.weight", "b.bias"]
    assert out["sent"]["args"] == {"group": "group", "packed": True, "buffer": 1 << 20}
    # the other ranks never touch the servers, but walk their source (its collectives)
    assert out["rank1"]["calls"] == [] and out["rank1"]["iterated"] == 2
    # vLLM 0.24's own engine parses what the servers receive: each server its rank offset, the packed geometry
    assert [p["rank_offset"] for p in out["per_server"]] == [1, 2]
    assert {p["world_size"] for p in out["per_server"]} == {3}
    assert out["update"] == {"names": ["a.weight", "b.bias"], "dtypes": ["bfloat16", "bfloat16"],
                             "shapes": [[2, 3], [4]], "packed": True, "buffer": 1 << 20}


def test_ipc_sender_posts_each_bucket_that_vllm_024_parses():
    out = _run(IPC)
    assert out["calls"] == ["init", "start", "update", "finish"] and out["skyrl_engine"]
    assert out["init"] == {}
    assert out["update"]["names"] == ["a.weight", "b.bias"] and out["update"]["shapes"] == [[2, 3], [4]]
    assert out["update"]["packed"] is True and "GPU-0" in out["update"]["handles"][0]


def test_server_side_names_resolve_through_the_bridge():
    out = _run(SERVER_SIDE)
    # skyrl's 0.30 receive engines cannot run on 0.24's worker-owned lifecycle: vLLM's own engines receive
    assert out["receivers"] == {"skyrl_nccl": "NCCLWeightTransferEngine", "skyrl_ipc": "IPCWeightTransferEngine"}
    assert out["start_body"] == [["/start_weight_update", {"is_checkpoint_format": True}]]  # 0.24 needs a body
    assert out["bound"] and out["reuse_port"] == 0
    assert out["frontend_args"] == "vllm.entrypoints.openai.cli_args"
