"""The demo's check of skyrl 0.4's vLLM servers after a sync, over the wire as it runs on the GPU machines.

A vLLM model of a tiny checkpoint, built on the CPU and loaded through its own ``load_weights``, sits behind vLLM's
real ``/collective_rpc`` route (its FastAPI router, served by uvicorn); skyrl 0.4's real ``RemoteInferenceClient``
fans the call out; our worker extension, named by the host adapter and resolved and mixed into a worker class as
vLLM's worker wrapper does, answers it. STAND-IN: the engine client between the route and the worker (vLLM's
``AsyncLLM``, which needs a GPU) is a class here that calls vLLM's own ``run_method`` on the one worker.

Asserted: every HF-named tensor the servers report (q/k/v and gate/up cut back out of vLLM's fused parameters)
has the digest of the checkpoint's tensor in the engine's dtype, and a name the engine lacks is not reported.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks

pytestmark = pytest.mark.slow


def _read_back_over_http(rank, world_size, hf_dir: str, names: list[str]):
    import asyncio
    import socket
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI
    from safetensors.torch import load_file
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from vllm.entrypoints.serve.dev.rpc.api_router import attach_router
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.serial_utils import run_method

    from skyrl_megatron.demo.experiment import vllm_server_digests
    from skyrl_megatron.hosts.skyrl_0_4 import WEIGHT_READ_BACK
    from skyrl_megatron.testing import vllm_model_on_cpu

    model = vllm_model_on_cpu(hf_dir, torch.bfloat16)
    state = load_file(f"{hf_dir}/model.safetensors")
    model.load_weights((name, tensor.to(torch.bfloat16)) for name, tensor in state.items())

    class WorkerBase:
        pass

    class Worker(WorkerBase):
        def get_model(self):
            return model

    Worker.__bases__ = Worker.__bases__ + (resolve_obj_by_qualname(WEIGHT_READ_BACK),)  # as vLLM's WorkerWrapperBase
    worker = Worker()

    class OneWorkerEngine:  # STAND-IN for AsyncLLM's collective_rpc over its workers
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [run_method(worker, method, args, kwargs or {})]

    app = FastAPI()
    attach_router(app)
    app.state.engine_client = OneWorkerEngine()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"

    async def read_back():
        client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1)
        try:
            return await vllm_server_digests(client, names)
        finally:
            await client.aclose()

    try:
        return asyncio.run(read_back())
    finally:
        server.should_exit = True


def test_the_servers_weights_read_back_over_collective_rpc_equal_the_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from skyrl_megatron.digests import tensor_sha256

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=5, num_hidden_layers=2))
    checkpoint = load_file(f"{hf_dir}/model.safetensors")
    expected = {name: tensor_sha256(tensor.to(torch.bfloat16)) for name, tensor in checkpoint.items()}
    layer = "model.layers.1"
    fused = [f"{layer}.self_attn.{p}_proj.weight" for p in "qkv"] + [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up")]
    names = [*fused, "model.norm.weight", "model.layers.0.input_layernorm.weight", "model.no_such.weight"]

    (per_worker,) = run_on_ranks(_read_back_over_http, 1, hf_dir, names, timeout=300)[0]
    assert sorted(per_worker) == sorted(names[:-1])
    assert per_worker == {name: expected[name] for name in names[:-1]}
