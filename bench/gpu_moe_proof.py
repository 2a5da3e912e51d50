"""Multi-GPU MoE proof, 4 GPUs, bf16: a Qwen3-30B-A3B-shaped model with 4 layers.

Same HF weights (random, saved once) under three layouts: EP1 on one GPU, EP4 (DP4) and TP2 x EP2
(SP, DP2) on four. Every rank scores the same RL-shaped batch and trains on it, so all layouts do the
same arithmetic up to bf16 reduction order.

1. Logprob parity of EP4 and TP2xEP2 against EP1 before training (mean and max |diff|).
2. Two training steps (policy-gradient loss, distributed optimizer): loss and grad norm per step in
   each layout, tokens/s of the second step.
3. Checkpoint (model, distributed optimizer, scheduler) after the two EP4 steps, reloaded under
   TP2 x EP2: its logprobs against EP4's after training; then one more step in both, which shows the
   Adam moments came back (a fresh optimizer's first step differs).

Usage (4 GPUs): python bench/gpu_moe_proof.py --out moe.json
Check on CPU first (gloo, 4 ranks, a tiny MoE of the same structure, fp32): MOE_PROOF_CPU=1 python ...
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_model_checks import _pg_objective, free_port as _free_port  # same directory

# the script itself, checked before device time is spent on it; spawned ranks inherit the variable
ON_CPU = os.environ.get("MOE_PROOF_CPU") == "1"
DEVICE, DTYPE = ("cpu", "fp32") if ON_CPU else ("cuda", "bf16")
SHAPE = dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
             vocab_size=151936, max_position_embeddings=40960, norm_topk_prob=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             tie_word_embeddings=False)
ROWS, PROMPT, RESPONSE = 8, 256, 256
if ON_CPU:
    SHAPE.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=256)
    ROWS, PROMPT, RESPONSE = 8, 8, 8
STEPS = 2


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(directory: Path) -> str:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**SHAPE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        AutoModelForCausalLM.from_config(config, dtype=torch.float32 if ON_CPU else torch.bfloat16).save_pretrained(directory)
    if not ON_CPU:
        torch.cuda.empty_cache()
    return str(directory)


def rank_main(rank: int, world: int, port: int, hf_dir: str, layout: dict, ckpt: str, results) -> None:
    from megatron.core import parallel_state as ps

    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    faulthandler.dump_traceback_later(480, exit=True, file=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    init_distributed(DEVICE)
    parallel = ParallelConfig(tensor=layout["tp"], expert=layout["ep"], sequence_parallel=layout["tp"] > 1)
    initialize_model_parallel(parallel, seed=0)
    ddp = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype=DTYPE, wrap_with_ddp=True, ddp_config=ddp))
    settings = OptimizerSettings.from_host_config({"lr": 1e-5, "weight_decay": 0.0, "max_grad_norm": 1.0}, {}, 100, DTYPE)
    optimizer = settings.build_optimizer(built.chunks)
    scheduler = settings.build_scheduler(optimizer)
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_optimizer(optimizer)
    batch = make_rl_batch(ROWS, PROMPT, RESPONSE, vocab_size=SHAPE["vocab_size"], seed=1)
    response = {"loss_mask": batch["loss_mask"], "advantages": torch.randn(ROWS, RESPONSE, generator=torch.Generator().manual_seed(2))}

    def logprobs():
        return runner.response_logprobs(batch["sequences"], batch["attention_mask"], RESPONSE,
                                        MicroBatching(micro_batch_size=4)).float().cpu()

    def train_step() -> dict:
        _sync()
        started = time.perf_counter()
        metrics = runner.train_mini_batch(batch["sequences"], batch["attention_mask"], response, _pg_objective,
                                          MicroBatching(max_tokens=4096), dp_group=ps.get_data_parallel_group())
        step = optimizer_step(optimizer, scheduler)
        _sync()
        seconds = time.perf_counter() - started
        return {"loss": float(metrics["loss"]), "grad_norm": step.grad_norm, "seconds": seconds,
                "tokens_per_s_per_gpu": int(batch["attention_mask"].sum()) / seconds / world}

    def timed(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - started

    out = {"layout": layout["name"]}
    if layout.get("load"):
        out["load_seconds"] = timed(lambda: load_checkpoint(layout["load"], built.chunks, optimizer, scheduler))
        out["logprobs_after_load"] = logprobs()
        out["step_after_load"] = train_step()
        out["logprobs_after_extra_step"] = logprobs()
    else:
        out["logprobs_before"] = logprobs()
        out["steps"] = [train_step() for _ in range(STEPS)]
        out["logprobs_after"] = logprobs()
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
        if layout.get("save"):
            out["save_seconds"] = timed(
                lambda: save_checkpoint(layout["save"], built.chunks, optimizer, scheduler, step=STEPS))
            out["step_after_save"] = train_step()
            out["logprobs_after_extra_step"] = logprobs()
    if rank == 0:
        results[layout["name"]] = out
        # printed as each layout finishes, so a run cut short still reports what it measured
        printable = {k: v for k, v in out.items() if not k.startswith("logprobs")}
        print(f"{layout['name']}: {json.dumps(printable)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def spawn_with_fresh_port(fn, world: int, *args, attempts: int = 3) -> None:
    """mp.spawn with a new rendezvous port on EADDRINUSE: a free port can be taken between our probe
    and rank 0's listen (seen on the 4-GPU machine). Nothing ran before the rendezvous, so a retry
    repeats no work."""
    for attempt in range(attempts):
        try:
            mp.spawn(fn, args=(world, _free_port(), *args), nprocs=world)
            return
        except mp.ProcessRaisedException as error:
            if "EADDRINUSE" not in str(error) or attempt == attempts - 1:
                raise
            print(f"rendezvous port taken; retrying ({attempt + 1}/{attempts - 1})", flush=True)


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b)[mask].abs()
    return {"mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item()}


def main() -> None:
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="moe.json")
    args = parser.parse_args()
    if not ON_CPU:
        assert torch.cuda.device_count() >= 4, "needs 4 GPUs (MOE_PROOF_CPU=1 checks the script on CPU)"
    mp.set_start_method("spawn", force=True)
    # tmpfs: the checkpoint holds about 38 GB of optimizer state, and a disk would time the disk
    work = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    hf_dir = write_checkpoint(work / "qwen3-30b-a3b-4layers")
    ckpt = str(work / "ckpt")
    layouts = [
        dict(name="EP1", world=1, tp=1, ep=1),
        dict(name="EP4", world=4, tp=1, ep=4, save=ckpt),
        dict(name="TP2xEP2", world=4, tp=2, ep=2),
        dict(name="TP2xEP2 loaded from EP4", world=4, tp=2, ep=2, load=ckpt),
    ]
    manager = mp.Manager()
    results = manager.dict()
    for layout in layouts:
        print(f"{time.strftime('%H:%M:%S')} {layout['name']}", flush=True)
        spawn_with_fresh_port(rank_main, layout["world"], hf_dir, layout, ckpt, results)
    mask = make_rl_batch(ROWS, PROMPT, RESPONSE, vocab_size=SHAPE["vocab_size"], seed=1)["loss_mask"].bool()
    ref = results["EP1"]
    summary = {"gpu": torch.cuda.get_device_name(0) if not ON_CPU else "CPU check", "shape": SHAPE, "response_tokens": int(mask.sum()), "layouts": {}}
    for name in ("EP1", "EP4", "TP2xEP2"):
        r = results[name]
        entry = {"steps": r["steps"], "peak_gib": r["peak_gib"]}
        if name != "EP1":
            entry["logprobs_before_vs_EP1"] = _diff(r["logprobs_before"], ref["logprobs_before"], mask)
            entry["logprobs_after_vs_EP1"] = _diff(r["logprobs_after"], ref["logprobs_after"], mask)
        summary["layouts"][name] = entry
    summary["training_moved_logprobs_EP1"] = _diff(ref["logprobs_after"], ref["logprobs_before"], mask)
    loaded, saved = results["TP2xEP2 loaded from EP4"], results["EP4"]
    summary["checkpoint"] = {
        "save_seconds_EP4": saved["save_seconds"],
        "load_seconds_TP2xEP2": loaded["load_seconds"],
        "reloaded_vs_EP4_logprobs": _diff(loaded["logprobs_after_load"], saved["logprobs_after"], mask),
        "one_more_step_loss": {"EP4": saved["step_after_save"]["loss"], "reloaded": loaded["step_after_load"]["loss"]},
        "one_more_step_grad_norm": {"EP4": saved["step_after_save"]["grad_norm"],
                                    "reloaded": loaded["step_after_load"]["grad_norm"]},
        "after_one_more_step_logprobs": _diff(loaded["logprobs_after_extra_step"],
                                              saved["logprobs_after_extra_step"], mask),
        "moved_by_the_extra_step": _diff(saved["logprobs_after_extra_step"], saved["logprobs_after"], mask),
    }
    print(json.dumps(summary, indent=2), flush=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
