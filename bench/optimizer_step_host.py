"""Wall time of our optimizer step on a MoE with many parameter tensors, one process, no Ray.

A Qwen3-MoE with tiny widths but the parameter count of a real one (128 experts x 8 layers: 2,107 tensors, as
Qwen3-30B-A3B's 8-layer bench model) is built with DDP and the distributed optimizer, one backward runs, and
`optim.optimizer_step` is timed over `--steps` steps (the first left out). The kernels are tiny, so the time is
the step's host work: what the MoE's optimizer step pays per parameter tensor. `--megatron-per-tensor` keeps
Megatron's per-parameter shard copies and norm filter instead of ours (`optimizer_prebuilt.py`), for the
comparison; `--masters` picks fp32 masters (the default here), compact ones (`compact_master_weights`) or compact
ones stepped by compact adam (`compact_adam`); `--profile` prints a cProfile of one more step.

    python bench/optimizer_step_host.py                      # CPU runtime (gloo)
    python bench/optimizer_step_host.py --megatron-per-tensor
    python bench/optimizer_step_host.py --gpu                # one GPU: the host time as a GPU run has it
    python bench/optimizer_step_host.py --gpu --masters compact_adam

On CPU every torch call also passes through the CPU runtime's device mode, which a GPU run does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--megatron-per-tensor", action="store_true",
                        help="Megatron's per-parameter shard copies and norm filter (not optimizer_prebuilt.py's)")
    parser.add_argument("--masters", choices=("fp32", "compact", "compact_adam"), default="fp32",
                        help="fp32 masters, compact ones, or compact ones stepped by compact adam")
    parser.add_argument("--profile", action="store_true", help="a cProfile of one more step")
    parser.add_argument("--callers", metavar="REGEX", help="with --profile: who calls the functions matching REGEX")
    args = parser.parse_args()

    import torch
    from megatron.core.distributed import finalize_model_grads

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.testing import init_single_rank, make_tiny_hf_model

    init_single_rank("cuda" if args.gpu else "cpu", port=29561)
    hf_dir = make_tiny_hf_model("qwen3_moe", Path(tempfile.mkdtemp()) / "moe", num_experts=args.experts,
                                num_experts_per_tok=8, moe_intermediate_size=16, num_hidden_layers=args.layers)
    built = build_model(ModelSpec(str(hf_dir), dtype="bf16", transformer_overrides={"cross_entropy_loss_fusion": False},
                                  wrap_with_ddp=True, ddp_config={"use_distributed_optimizer": True,
                                                                  "grad_reduce_in_fp32": True}))
    (model,) = built.chunks
    host = {"lr": 1e-5, "adam_betas": [0.9, 0.999], "weight_decay": 0.01, "max_grad_norm": 1e-3,
            "num_warmup_steps": 0, "scheduler": "constant"}
    settings = OptimizerSettings.from_host_config(host, {}, num_training_steps=args.steps + 2, dtype="bf16")
    copies = mock.patch("skyrl_megatron.optimizer_prebuilt.install", return_value="--megatron-per-tensor") \
        if args.megatron_per_tensor else contextlib.nullcontext()
    with copies:
        optimizer = settings.build_optimizer(built.chunks, compact_master_weights=args.masters != "fp32",
                                             compact_adam=args.masters == "compact_adam")
    scheduler = settings.build_scheduler(optimizer)
    device = torch.device("cuda") if args.gpu else torch.device("cpu")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(15, device=device).unsqueeze(0)

    def backward() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        finalize_model_grads([model])

    def timed_step() -> float:
        backward()
        if args.gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = optimizer_step(optimizer, scheduler)
        if args.gpu:
            torch.cuda.synchronize()
        assert not result.skipped, result
        return time.perf_counter() - started

    seconds = [timed_step() for _ in range(args.steps)][1:]
    tensors = sum(1 for _ in model.parameters())
    print(f"{tensors} parameter tensors, {'GPU' if args.gpu else 'CPU runtime'}, "
          f"{'Megatron' if args.megatron_per_tensor else 'our'} per-tensor work, {args.masters} masters: optimizer step median "
          f"{statistics.median(seconds) * 1e3:.1f} ms over {len(seconds)} steps ({', '.join(f'{s * 1e3:.1f}' for s in seconds)})")
    if args.profile:
        backward()
        profiler = cProfile.Profile()
        profiler.enable()
        optimizer_step(optimizer, scheduler)
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("cumulative")
        stats.print_stats(30)
        if args.callers:
            stats.print_callers(args.callers)


if __name__ == "__main__":
    main()
