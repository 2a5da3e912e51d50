"""A dying inference engine (our HF engine on CPU, skyrl 0.4's client and our weight-sync sender).

Two engine actors, killed (SIGKILL) one at a time:
* engine 0 during a weight sync (after the first tensor of a bucket went out): the sender fails with one
  `EngineFailure` naming it (index, pid and node, from the driver's failure registry), within the broadcast
  group's timeout; engine 1, which received part of the bucket, wrote none of it (its weights are bitwise
  as before);
* engine 1 during generation: the client's generate fails with one error naming it; the driver's `explain`
  names both (how skyrl-train 0.3.1's own client, which calls the engine actors itself, gets them named);
* afterwards no engine process is left once Ray shuts down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import torch

pytestmark = pytest.mark.slow

SYNC_TIMEOUT_S = 2.0
LONG_REPLY = 4000  # tokens: a generation still running when its engine is killed


def _engine_pids(count: int) -> dict[int, int]:
    """Engine index -> pid, from the registry (each engine registers as its actor starts)."""
    import ray

    from skyrl_megatron.failures import REGISTRY_NAME

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        entries = ray.get(ray.get_actor(REGISTRY_NAME).entries.remote())
        pids = {identity.rank: identity.pid for identity, _ in entries.values() if identity.role == "HF engine"}
        if len(pids) == count:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"engines did not register: {pids}")


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def _generate_while_killed(client, pid: int) -> str:
    from skyrl_megatron.failures import EngineFailure

    # one prompt: the client's first call goes to engine 0 alone; thousands of tokens take seconds
    long = {"max_tokens": LONG_REPLY, "ignore_eos": True, "min_tokens": LONG_REPLY}
    generation = asyncio.ensure_future(client.generate({"prompt_token_ids": [[5, 6, 7]], "sampling_params": long}))
    await asyncio.sleep(1.0)
    _kill(pid)
    with pytest.raises(EngineFailure) as failure:
        await generation
    return str(failure.value)


async def _sync_while_killed(client, names, tensors, pid: int) -> str:
    from skyrl_megatron.failures import EngineFailure
    from skyrl_megatron.weights import WeightBucket
    from skyrl_megatron.workers.engine_sync import EngineBroadcastSender

    sender = await EngineBroadcastSender.connect(client, on_gpu=False, timeout_s=SYNC_TIMEOUT_S)
    broadcast = sender.group.broadcast
    sent = []

    def broadcast_then_kill(tensor):
        result = broadcast(tensor)
        sent.append(1)
        if len(sent) == 1:
            _kill(pid)
            time.sleep(0.5)  # its connections are closed before the next tensor
        return result

    sender.group.broadcast = broadcast_then_kill
    bucket = WeightBucket(names=list(names), tensors=list(tensors), dtypes=[t.dtype for t in tensors],
                          shapes=[tuple(t.shape) for t in tensors])
    with pytest.raises(EngineFailure) as failure:
        await sender.send([bucket])
    return str(failure.value)


def test_a_dying_engine_is_named_and_leaves_nothing_corrupted(tmp_path):
    import ray
    import torch.distributed as dist

    from skyrl_megatron.engines.client import EngineClient, create_engine_client
    from skyrl_megatron.failures import explain, start_registry
    from skyrl_megatron.testing import make_tiny_hf_model
    from skyrl_megatron.testing.distributed import free_port

    hf_dir = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=1, max_position_embeddings=LONG_REPLY + 16)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        start_registry()
        client = create_engine_client(2, hf_dir)
        asyncio.run(client.is_sleeping())  # every engine is up
        pids = _engine_pids(2)
        node = ray.util.get_node_ip_address()

        held = ray.get(client.engines[1].named_weights.remote())
        before = ray.get(client.engines[1].weight_digests.remote())
        names = list(held)
        message = asyncio.run(_sync_while_killed(client, names, [held[n] + 1 for n in names], pids[0]))
        assert message.startswith(f"HF engine 0 of 2 (pid {pids[0]} on {node}) failed during a weight sync: "), message
        assert "The trainer's weights and checkpoints are untouched; rerun to resume from the last checkpoint" in message
        time.sleep(SYNC_TIMEOUT_S + 1)  # engine 1 gives up on the rest of the bucket
        assert ray.get(client.engines[1].weight_digests.remote()) == before

        survivor = EngineClient(client.engines[1:], str(hf_dir), "float32")
        message = asyncio.run(_generate_while_killed(survivor, pids[1]))
        assert message.startswith(f"HF engine 1 of 2 (pid {pids[1]} on {node}) failed during generation: "), message
        # skyrl-train 0.3.1's own client calls the engine actors itself: the driver's explanation names them
        explained = str(explain(RuntimeError("the host's own error")))
        assert f"HF engine 0 of 2 (pid {pids[0]}" in explained and f"HF engine 1 of 2 (pid {pids[1]}" in explained
    finally:
        dist.destroy_process_group()
        ray.shutdown()
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids.values() if psutil.pid_exists(pid)]
