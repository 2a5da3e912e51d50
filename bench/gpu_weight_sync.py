"""GPU check of weight sync and of the memory planner, on a 2-GPU machine.

Trainer: our Megatron policy model of the Qwen3-1.7B shape (random weights, saved once as an HF
checkpoint, loaded through the bridge), TP=2 + SP on GPUs 0 and 1, bf16. Receiver: a separate process
standing in for vLLM, holding the Hugging Face model of the same shape on GPU 1, that receives through
the host's own receivers (skyrl_train.weight_sync) and loads what it receives.

1. Export rate: our streamed HF export (`weights.iter_weight_buckets`) alone, GB/s, at TP=1 (one rank of
   a world-1 model built beforehand) and at TP=2.
2. CUDA IPC (the host's colocated strategy): every trainer rank packs each chunk into one buffer and
   shares its IPC handle; the receiver, on GPU 1, opens rank 1's. 1 GiB chunks (the host's default).
3. NCCL broadcast (the host's strategy when not colocated): trainer rank 0 (GPU 0) broadcasts each
   tensor to the receiver (GPU 1) in a group of their own.
   After each: SHA-256 of every received tensor vs the trainer's export -> bitwise equal?; the
   receiver's HF logits vs ours on one sequence.
4. Planner: one training step (1 x 4096 tokens, distributed optimizer) at TP=2 + SP: measured peak
   memory per GPU vs `skyrl-megatron plan`'s estimate for the same layout and batch.

Usage (2 GPUs): python bench/gpu_weight_sync.py --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import sys
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_model_checks import _pg_objective, free_port as _free_port, qwen3_config  # same directory

MODEL = "qwen3-1.7b"
HANG_SECONDS = float(os.environ.get("SYNC_BENCH_HANG_SECONDS", "400"))


def _progress(message: str) -> None:
    print(f"[{os.getpid()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _watchdog() -> None:
    """A stuck collective prints every thread's stack instead of eating the whole time limit."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=sys.stderr)
IPC_CHUNK_GB = 1.0
PLAN_TOKENS = 4096


def write_checkpoint(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    config = qwen3_config(MODEL)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


# ----------------------------------------------------------------------------------------------
# Receiver: the inference engine's side, through the host's receivers
# ----------------------------------------------------------------------------------------------


def receiver_main(conn, hf_dir: str, gpu: int) -> None:
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.activation import activate
    from skyrl_megatron.digests import tensor_sha256

    _watchdog()
    activate()  # the host's compat fixes (its broadcast group helper fails on torch >= 2.10)
    torch.cuda.set_device(gpu)
    # vLLM's workers have a default group; the host's broadcast receiver computes its rank from it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    parameters = dict(model.named_parameters(remove_duplicate=False))
    receiver, received = None, set()
    _progress("receiver ready")
    while True:
        kind, payload = conn.recv()
        _progress(f"receiver: {kind}")
        try:
            if kind == "init":
                receiver = payload.strategy_type().create_receiver(payload.for_engine(0, 1, 1))
                received = set()
                reply = "ok"
            elif kind == "update":
                with torch.no_grad():
                    for name, tensor in receiver.receive_weights(payload):
                        parameters[name].copy_(tensor)  # bitwise: same dtype and shape
                        received.add(name)
                torch.cuda.synchronize()
                reply = "ok"
            elif kind == "digests":  # after the timed sync: of what was loaded
                reply = {name: tensor_sha256(parameters[name]) for name in received}
                received = set()
            elif kind == "logits":
                with torch.no_grad():
                    reply = model(payload.cuda()).logits.float().cpu()
            elif kind == "stop":
                conn.send("bye")
                return
        except Exception as error:  # report, keep serving: the trainer decides
            reply = error
        conn.send(reply)


class PipeClient:
    """Stands in for the host's InferenceEngineClient: forwards its calls to the receiver process."""

    def __init__(self, conn):
        self.conn = conn

    def call(self, kind: str, payload=None):
        self.conn.send((kind, payload))
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def init_weight_update_communicator(self, init_info):
        return await asyncio.to_thread(self.call, "init", init_info)

    async def update_named_weights(self, request):
        return await asyncio.to_thread(self.call, "update", request)

    async def reset_prefix_cache(self):
        return None


# ----------------------------------------------------------------------------------------------
# Trainer ranks
# ----------------------------------------------------------------------------------------------


def _strategy_config(strategy: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "generator": {
            "weight_sync_backend": "nccl",
            "model_dtype": "bfloat16",
            "num_inference_engines": 1,
            "inference_engine_tensor_parallel_size": 1,
            "inference_engine_pipeline_parallel_size": 1,
            "inference_engine_data_parallel_size": 1,
            "weight_transfer_threshold_cuda_ipc_GB": IPC_CHUNK_GB,
            "override_existing_update_group": "enable",
        },
        "trainer": {"placement": {"colocate_all": strategy == "cuda_ipc"}},
    })


async def _sync(built, strategy: str, client) -> dict:
    """What our policy worker's init_weight_sync_state + broadcast_to_inference_engines do, timed."""
    from skyrl_train.weight_sync import get_transfer_strategy_cls

    from skyrl_megatron import host_api
    from skyrl_megatron.weights import iter_weight_buckets

    cfg = _strategy_config(strategy)
    strategy_cls = get_transfer_strategy_cls(cfg)
    init_info = strategy_cls.create_init_info(cfg)
    init_info = [init_info]
    dist.broadcast_object_list(init_info, src=0)  # the port rank 0 picked
    tasks = [asyncio.to_thread(strategy_cls.create_sender, init_info=init_info[0], inference_client=client)]
    if dist.get_rank() == 0:
        tasks.append(client.init_weight_update_communicator(init_info[0]))
    sender = (await asyncio.gather(*tasks))[0]
    dist.barrier()
    torch.cuda.synchronize()
    started = time.perf_counter()
    buckets = iter_weight_buckets(built, host_api.weight_sync_bucket_bytes(cfg, strategy_cls), dtype=torch.bfloat16,
                                  device=torch.cuda.current_device())
    await sender.send_chunks(host_api.weight_chunk(b) for b in buckets)
    torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - started
    # no sender.teardown(): destroying the NCCL group while the receiver keeps it blocks (the host
    # never tears its senders down either)
    return {"strategy": strategy_cls.__name__, "seconds": seconds, "bytes": buckets.report.bytes,
            "chunks": buckets.report.buckets, "GB_per_s": buckets.report.bytes / seconds / 1e9}


def _export_rate(built) -> dict:
    from skyrl_megatron.weights import iter_weight_buckets

    torch.cuda.synchronize()
    started = time.perf_counter()
    buckets = iter_weight_buckets(built, int(IPC_CHUNK_GB * 2**30), dtype=torch.bfloat16,
                                  device=torch.cuda.current_device())
    for _ in buckets:
        pass
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": buckets.report.bytes, "GB_per_s": buckets.report.bytes / seconds / 1e9,
            "peak_held_GiB": buckets.report.peak_held_bytes / 2**30}


def _digests(built) -> dict[str, str]:
    from skyrl_megatron.digests import tensor_sha256
    from skyrl_megatron.weights import iter_hf_weights

    return {name: tensor_sha256(t) for name, t in iter_hf_weights(built, dtype=torch.bfloat16)}


def _our_logits(built, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    (model,) = built.chunks
    positions = torch.arange(tokens.shape[1], device="cuda").unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens.cuda(), positions, None)
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., : built.provider.vocab_size].float().cpu()


def trainer_main(rank: int, world: int, port: int, hf_dir: str, conn, results: dict) -> None:
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from skyrl_megatron.activation import activate

    _watchdog()
    activate()
    init_distributed("cuda")
    _progress(f"trainer rank {rank}/{world}: process group up")
    parallel = ParallelConfig(tensor=world, sequence_parallel=world > 1)
    initialize_model_parallel(parallel, seed=0)
    out = {}
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="bf16"))
    _progress(f"trainer rank {rank}: model built")
    out["export"] = _export_rate(built)
    _progress(f"trainer rank {rank}: export {out['export']}")
    if world > 1:
        client = PipeClient(conn) if conn is not None else None
        expected = _digests(built)
        tokens = torch.randint(0, 151936, (1, 64), generator=torch.Generator().manual_seed(1))
        ours = _our_logits(built, tokens)
        for strategy in ("cuda_ipc", "broadcast"):
            _progress(f"trainer rank {rank}: {strategy}")
            result = asyncio.run(_sync(built, strategy, client))
            if rank == 0:
                received = client.call("digests")
                result["tensors_received"] = len(received)
                result["tensors_expected"] = len(expected)
                result["bitwise_equal"] = received == expected
                theirs = client.call("logits", tokens)
                result["logits_max_abs_diff_vs_ours"] = float((theirs - ours).abs().max())
            out[strategy] = result
            _progress(f"trainer rank {rank}: {strategy} {result}")
        del built
        torch.cuda.empty_cache()
        out["planner"] = _planner_check(hf_dir, parallel)
    if rank == 0:
        if conn is not None:
            conn.send(("stop", None))
            conn.recv()
        results.update(out)
    dist.barrier()
    dist.destroy_process_group()


def _planner_check(hf_dir: str, parallel) -> dict:
    """One training step of PLAN_TOKENS tokens: measured peak vs the planner's estimate."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.planner import BatchPlan, Layout, estimate, load_model_arch

    torch.cuda.reset_peak_memory_stats()
    ddp = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="bf16", wrap_with_ddp=True, ddp_config=ddp))
    settings = OptimizerSettings.from_host_config({"lr": 1e-6, "weight_decay": 0.01, "max_grad_norm": 1.0}, {}, 100, "bf16")
    optimizer = settings.build_optimizer(built.chunks)
    scheduler = settings.build_scheduler(optimizer)
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_optimizer(optimizer)
    sequences = torch.randint(0, 151936, (1, PLAN_TOKENS), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, PLAN_TOKENS, dtype=torch.long)
    response = {"loss_mask": torch.ones(1, PLAN_TOKENS // 2), "advantages": torch.ones(1, PLAN_TOKENS // 2)}
    for _ in range(2):
        runner.train_mini_batch(sequences, mask, response, _pg_objective, MicroBatching(max_tokens=PLAN_TOKENS))
        optimizer_step(optimizer, scheduler)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    layout = Layout(nodes=1, gpus_per_node=parallel.tensor, tp=parallel.tensor)
    plan = estimate(load_model_arch(hf_dir), layout, BatchPlan(micro_batch_tokens=PLAN_TOKENS))
    planned_without_overhead = plan.total - plan.overhead
    return {
        "layout": f"TP={parallel.tensor}{'+SP' if parallel.sequence_parallel else ''}",
        "measured_peak_allocated_GiB": measured / 2**30,
        "measured_peak_reserved_GiB": reserved / 2**30,
        "planned_total_GiB": plan.total / 2**30,
        "planned_without_fixed_overhead_GiB": planned_without_overhead / 2**30,
        "relative_error_vs_allocated": planned_without_overhead / measured - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="weight_sync.json")
    args = parser.parse_args()
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    mp.set_start_method("spawn", force=True)
    _watchdog()
    work = Path(tempfile.mkdtemp())
    hf_dir = str(write_checkpoint(work / MODEL))
    _progress(f"checkpoint written: {hf_dir}")
    manager = mp.Manager()
    results = {"gpu": torch.cuda.get_device_name(0), "model": MODEL}

    single = manager.dict()
    mp.spawn(trainer_main, args=(1, _free_port(), hf_dir, None, single), nprocs=1)
    results["tp1"] = dict(single)

    trainer_end, receiver_end = mp.Pipe()
    receiver = mp.Process(target=receiver_main, args=(receiver_end, hf_dir, 1))
    receiver.start()
    pair = manager.dict()
    mp.spawn(trainer_main, args=(2, _free_port(), hf_dir, trainer_end, pair), nprocs=2)
    receiver.join(timeout=60)
    results["tp2"] = dict(pair)
    print(json.dumps(results, indent=2))
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
