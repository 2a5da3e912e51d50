"""The two-GPU launch of `gpu_device_all_to_all_check.py`, kept apart from the check itself:
the MoE shape arguments, the environment that keeps NVLink multicast off on the lent machines, and one
process per GPU (forked on CPU in smoke mode, where no CUDA context exists to inherit)."""

from __future__ import annotations

import argparse
import os

import torch.multiprocessing as mp

from skyrl_megatron.testing.distributed import free_port

WORLD = 2
# NVLink multicast stays off on the lent machines (shared GPUs); set before NCCL or NVSHMEM start.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def add_moe_shape_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    """Qwen3-30B-A3B's routing shape per rank (hidden 2048, 128 experts, top-8), `tokens` tokens."""
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)


def launch_ranks(run_rank, args, out_file: str, smoke: bool) -> None:
    """`run_rank(rank, WORLD, args, out_file)` in WORLD processes; raises what a failed rank raised."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.start_processes(run_rank, args=(WORLD, args, out_file), nprocs=WORLD, join=True,
                       start_method="fork" if smoke else "spawn")
