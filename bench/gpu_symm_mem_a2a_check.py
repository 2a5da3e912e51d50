"""Device-side all-to-all for MoE token dispatch at EP > 1 (issue 17): does torch's NVSHMEM path run here?

At EP > 1 Megatron's alltoall dispatcher copies the all-to-all's split sizes to the host and waits, once
per MoE layer and pass (`all_to_all_single` takes host lists): on a host-bound step the GPU then idles
while the host catches up (session 16: EP2 ran 0.63x of EP1 per GPU in training, 0.48x in scoring).
torch 2.11 ships all-to-all ops whose split sizes stay on the device, on NVSHMEM symmetric memory:
`symm_mem.all_to_all_vdev_2d` sends rows grouped by (destination rank, local expert) and lands them
grouped by (local expert, source rank), which is also the order the grouped expert GEMMs want (the
dispatcher's chunk regrouping disappears), and `all_to_all_vdev_2d_offset` sends them back.

This script answers, before any dispatcher is written on them, on 2 GPUs of one host:
1. whether NVSHMEM is available to this torch build (exit 2 if not);
2. parity: the dispatch equals `all_to_all_single` on host splits followed by the expert-major regrouping,
   row for row, and dispatch + return gives back the input exactly (bf16 rows: a copy, so bitwise);
3. time per dispatch + return at Qwen3-30B-A3B's EP2 shape (8,192 tokens x top-8 routed rows per rank,
   hidden 2048, 64 local experts per rank, skewed routing): the host-split path (device-to-host copy of
   the splits and its wait, `all_to_all_single`, regrouping) against the device-split path, each with a
   compute kernel queued before it, so the host-split path's wait shows as it does inside a model.

    python bench/gpu_symm_mem_a2a_check.py [--tokens 8192] [--topk 8] [--hidden 2048] [--experts 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def routed_counts(tokens: int, topk: int, experts: int, seed: int, device) -> torch.Tensor:
    """Rows per global expert from a skewed (Zipf-like) top-k routing of `tokens` tokens."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 0.5
    weights = weights[torch.randperm(experts, generator=generator)]
    choice = torch.multinomial(weights.expand(tokens, -1), topk, replacement=False, generator=generator)
    return torch.bincount(choice.flatten(), minlength=experts).to(device)


def host_split_dispatch(rows: torch.Tensor, counts: torch.Tensor, world: int, local_experts: int):
    """Megatron's way at EP > 1: split sizes to the host (a wait), all_to_all_single, regroup by expert."""
    send_per_rank = counts.view(world, local_experts).sum(1)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts)  # [source rank, local expert]
    send_sizes = send_per_rank.tolist()  # the device-to-host wait
    receive_sizes = received_counts.view(world, local_experts).sum(1).tolist()
    received = rows.new_empty(sum(receive_sizes), rows.shape[1])
    dist.all_to_all_single(received, rows, receive_sizes, send_sizes)
    # regroup [source rank, expert] chunks as [expert, source rank]
    chunks = received.split(received_counts.tolist())
    order = [source * local_experts + expert for expert in range(local_experts) for source in range(world)]
    return torch.cat([chunks[i] for i in order]), received_counts


def run_rank(rank: int, world: int, args, result_file: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    report: dict = {"device": torch.cuda.get_device_name(rank), "torch": torch.__version__}
    available = symm_mem.is_nvshmem_available()
    report["nvshmem_available"] = available
    if not available:
        if rank == 0:
            Path(result_file).write_text(json.dumps(report))
        dist.destroy_process_group()
        return
    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op where it is not
        symm_mem.enable_symm_mem_for_group(group_name)
    local_experts = args.experts // world
    splits = args.experts  # (destination rank, local expert) chunks
    rows_per_rank = args.tokens * args.topk
    counts = routed_counts(args.tokens, args.topk, args.experts, seed=rank, device=device)
    rows = torch.randn(rows_per_rank, args.hidden, dtype=torch.bfloat16, device=device)

    # symmetric buffers are allocated once, at the worst case: every rank sends all its rows to one rank
    send = symm_mem.empty(rows_per_rank, args.hidden, dtype=torch.bfloat16, device=device)
    land = symm_mem.empty(rows_per_rank * world, args.hidden, dtype=torch.bfloat16, device=device)
    back = symm_mem.empty(rows_per_rank, args.hidden, dtype=torch.bfloat16, device=device)
    in_splits = symm_mem.empty(splits, dtype=torch.int64, device=device)
    landed = symm_mem.empty(2, splits, dtype=torch.int64, device=device)  # splits, offsets (expert-major)
    returned = symm_mem.empty(2, splits, dtype=torch.int64, device=device)
    dist.barrier()

    def device_split_dispatch():
        send.copy_(rows)
        in_splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(send, land, in_splits, landed, group_name, major_align=1)

    def device_split_return():
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(land, back, landed, returned, group_name)

    # 2. parity
    expected, received_counts = host_split_dispatch(rows, counts, world, local_experts)
    device_split_dispatch()
    device_split_return()
    torch.cuda.synchronize()
    landed_rows = int(landed[0].sum())
    # each (expert, source rank) chunk sits at its offset (an empty expert still takes major_align rows)
    chunk_rows = [torch.arange(start, start + size, device=device)
                  for size, start in zip(landed[0].tolist(), landed[1].tolist())]
    report["dispatch_equal"] = bool(landed_rows == expected.shape[0]
                                    and torch.equal(land.index_select(0, torch.cat(chunk_rows)), expected))
    report["landed_splits_equal"] = bool(torch.equal(landed[0], received_counts.view(world, local_experts).t().flatten()))
    report["round_trip_equal"] = bool(torch.equal(back[:rows_per_rank], rows))

    # 3. time, each path behind a compute kernel (a model's attention and router would be there)
    weight = torch.randn(args.hidden, args.hidden, dtype=torch.bfloat16, device=device)
    activations = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)

    def host_path():
        activations @ weight
        grouped, _ = host_split_dispatch(rows, counts, world, local_experts)
        return grouped

    def device_path():
        activations @ weight
        device_split_dispatch()
        device_split_return()

    def host_round_trip():
        grouped = host_path()
        # the return all-to-all with the sizes already on the host (Megatron keeps them); timing only:
        # the rows go back in expert-major order, the same bytes as the real return
        sizes = counts.view(world, local_experts).sum(1).tolist()
        back_rows = rows.new_empty(rows_per_rank, args.hidden)
        receive_sizes = received_counts.view(world, local_experts).sum(1).tolist()
        dist.all_to_all_single(back_rows, grouped[: sum(receive_sizes)], sizes, receive_sizes)

    for name, fn in (("host_splits_ms", host_round_trip), ("device_splits_ms", device_path)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / args.inner)
        report[name] = round(statistics.median(times), 3)
    report.update(tokens=args.tokens, topk=args.topk, hidden=args.hidden, experts=args.experts, world=world,
                  rows_per_rank=rows_per_rank, landed_rows=landed_rows)
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(result_file).write_text(json.dumps({"ranks": gathered}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("symm_mem_a2a.json"))
    args = parser.parse_args(argv)
    world = 2
    if torch.cuda.device_count() < world:
        parser.error(f"needs {world} GPUs of one host")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    mp.spawn(run_rank, args=(world, args, str(args.out)), nprocs=world, join=True)
    result = json.loads(args.out.read_text())
    print(json.dumps(result, indent=1))
    ranks = result.get("ranks", [result])
    if not all(r.get("nvshmem_available") for r in ranks):
        return 2
    return 0 if all(r["dispatch_equal"] and r["round_trip_equal"] and r["landed_splits_equal"] for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
