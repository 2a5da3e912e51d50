"""Device-side all-to-all for MoE token dispatch at EP > 1 (issue 17): torch's 1-D NVSHMEM all-to-all.

At EP > 1 Megatron's alltoall dispatcher copies the all-to-all's split sizes to the host and waits, once
per MoE layer and pass (`all_to_all_single` takes host lists; its non-fused chunk regrouping reads the
counts on the host again): on a host-bound step the GPU then idles while the host catches up (session 16:
EP2 ran 0.63x of EP1 per GPU in training, 0.48x in scoring).

Session 17 found that torch 2.11's 2-D op, `symm_mem.all_to_all_vdev_2d`, refuses 64 local experts
(`Number of experts must be smaller than NUM_TILES16`). Its 1-D op, `symm_mem.all_to_all_vdev(input, out,
in_splits, out_splits_offsets, group_name)`, takes per-rank split sizes on the device (`in_splits`: rows
for each destination rank; it writes `out_splits_offsets[0]`, rows from each source rank, and
`out_splits_offsets[1]`, where each source's rows start in `out`: the exclusive prefix sum) and has no
expert limit. The rows then land grouped by source rank, then local expert; the expert-major order the
grouped GEMMs want is one gather whose index is computed on the device with static shapes: the output is
sized for the worst case (every rank sends all its rows here), and each output row finds its chunk by a
clamped `searchsorted` over the chunks' cumulative sizes (`chunk_gather_index`). The per-expert counts
travel in an all-gather of device tensors, as Megatron's dispatcher does already; it is also the barrier
the NVSHMEM op needs (it pulls from the peers' send buffers and does not wait for them after: a rank
must not refill its send buffer, nor start the next exchange, before every peer has finished the
previous one).

On 2 GPUs of one host, at Qwen3-30B-A3B's EP2 shape (8,192 tokens x top-8 per rank, hidden 2048, bf16, 128
experts: 64 per rank, routing drawn with a fixed seed), this script reports:
1. whether NVSHMEM is available (exit 2 if not) and the 2-D op's answer at this shape (one case);
2. parity of the 1-D path, bitwise, against the reference (host split sizes, `all_to_all_single`,
   Megatron's non-fused split-and-concatenate regrouping): dispatch, combine (the way back), round trip;
   the index math also against `skyrl_megatron.model.moe.token_sort.chunk_order_rows`;
3. whether the 1-D path makes a host sync: CUDA's sync debug mode set to 'error' around one round trip
   (the reference path is checked the same way, to show the check catches one), and whether the host
   runs ahead of a GPU kept busy (catches waits the debug mode cannot see, such as inside NVSHMEM);
4. time per dispatch and per dispatch + combine of both paths (median of --repeats, CUDA events), each
   behind a matrix product as in a model, and the memory of the symmetric buffers;
5. on each GPU alone, the scatters of the token permutation at this shape: `index_add_` (the backward of
   the permutation's `index_select`, top-k duplicates) and `scatter_add_` (Megatron's unpermute) against
   a gather by the inverse order and a sum over the k choices.
Exit 0 when every parity check holds, 1 on a mismatch, 2 without NVSHMEM, 3 when a rank failed (what each
rank had measured by then is in --out, with the error).

    python3 bench/gpu_symm_mem_a2a_check.py [--tokens 8192] [--topk 8] [--hidden 2048] [--experts 128] --out FILE
        (2 GPUs, plain torch: no wheels needed; about 40 s; partial per-rank reports FILE.rankN.partial
        are kept if a stage fails or hangs)
    python3 bench/gpu_symm_mem_a2a_check.py --smoke --out FILE   # CPU, gloo, the 1-D op emulated: the rest checked
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # two_gpu_launch, when imported by the tests

# the index math is the product's (model/moe/token_sort.py), checked here against Megatron's path
from skyrl_megatron.model.moe.token_sort import chunk_gather_index, expert_major_order, source_major_order  # noqa: E402
from skyrl_megatron.testing.reference_exchange import split_and_concatenate  # noqa: E402
from two_gpu_launch import SAFE_ENV, WORLD, add_moe_shape_arguments, launch_ranks  # noqa: E402



# ---------------------------------------------------------------------------------------------------
# Pure index math (CPU or GPU, no host sync): checked on CPU by tests/test_symm_mem_a2a_script.py;
# the regroup's (expert_major_order, source_major_order, chunk_gather_index) is imported above
# ---------------------------------------------------------------------------------------------------


def draw_routing(tokens: int, topk: int, experts: int, seed: int, device) -> torch.Tensor:
    """[tokens, topk] distinct experts per token, drawn from a mildly skewed (Zipf-like) preference."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 0.5
    weights = weights[torch.randperm(experts, generator=generator)]
    return torch.multinomial(weights.expand(tokens, -1), topk, replacement=False, generator=generator).to(device)


def permutation_of(routing: torch.Tensor, experts: int):
    """Megatron's argsort permute: (flat [expert, token] index per permuted row, token index per permuted
    row, rows per expert). Rows are expert-major, tokens ascending inside an expert."""
    tokens, topk = routing.shape
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=routing.device)
    routing_map.scatter_(1, routing, True)
    flat_sorted = routing_map.t().reshape(-1).argsort(descending=True, stable=True)[: tokens * topk]
    return flat_sorted, flat_sorted % tokens, torch.bincount(routing.flatten(), minlength=experts)


def token_rows_of(flat_sorted: torch.Tensor, routing: torch.Tensor, experts: int) -> torch.Tensor:
    """[tokens, topk]: the permuted row of each (token, choice), the inverse of the permutation, so the
    way back can gather in token order instead of scattering with atomics."""
    tokens, topk = routing.shape
    landed = torch.empty(tokens * experts, dtype=torch.int64, device=routing.device)
    landed.scatter_(0, flat_sorted, torch.arange(tokens * topk, device=routing.device))
    return landed[routing * tokens + torch.arange(tokens, device=routing.device)[:, None]]


def gather_sum(rows: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    """Sum of each token's k permuted rows, by a gather in token order (no atomics)."""
    tokens, topk = token_rows.shape
    return rows.index_select(0, token_rows.flatten()).view(tokens, topk, -1).sum(1)


# ---------------------------------------------------------------------------------------------------
# The two exchanges: torch's NVSHMEM op, and (smoke mode) the same contract on host splits over gloo
# ---------------------------------------------------------------------------------------------------


class VdevExchange:
    """Symmetric buffers for one `all_to_all_vdev` direction, allocated once at the worst case."""

    def __init__(self, in_rows: int, out_rows: int, hidden: int, dtype, device, group_name: str, world: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group_name
        self.input = symm_mem.empty(in_rows, hidden, dtype=dtype, device=device)
        self.out = symm_mem.empty(out_rows, hidden, dtype=dtype, device=device)
        self.in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        self.out_splits_offsets = symm_mem.empty(2, world, dtype=torch.int64, device=device)
        for buffer in self.buffers():
            symm_mem.rendezvous(buffer, group_name)

    def buffers(self):
        return (self.input, self.out, self.in_splits, self.out_splits_offsets)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def __call__(self) -> None:
        torch.ops.symm_mem.all_to_all_vdev(self.input, self.out, self.in_splits, self.out_splits_offsets, self.group_name)


class EmulatedExchange(VdevExchange):
    """The op's contract on plain tensors with host splits (smoke mode: gloo on CPU, no NVSHMEM)."""

    def __init__(self, in_rows: int, out_rows: int, hidden: int, dtype, device, group_name: str, world: int):
        self.input = torch.empty(in_rows, hidden, dtype=dtype, device=device)
        self.out = torch.empty(out_rows, hidden, dtype=dtype, device=device)
        self.in_splits = torch.empty(world, dtype=torch.int64, device=device)
        self.out_splits_offsets = torch.empty(2, world, dtype=torch.int64, device=device)

    def __call__(self) -> None:
        received = torch.empty_like(self.in_splits)
        dist.all_to_all_single(received, self.in_splits)
        send, receive = self.in_splits.tolist(), received.tolist()
        dist.all_to_all_single(self.out[: sum(receive)], self.input[: sum(send)], receive, send)
        self.out_splits_offsets[0].copy_(received)
        self.out_splits_offsets[1].copy_(torch.cumsum(received, 0) - received)


# ---------------------------------------------------------------------------------------------------
# The paths
# ---------------------------------------------------------------------------------------------------


class Shape:
    def __init__(self, args, world: int, rank: int):
        self.world, self.rank = world, rank
        self.tokens, self.topk, self.hidden, self.experts = args.tokens, args.topk, args.hidden, args.experts
        self.local_experts = args.experts // world
        self.rows = args.tokens * args.topk  # rows each rank sends (dropless: static)
        self.capacity = self.rows * world  # worst case received: every rank sends all its rows here
        self.mine = slice(rank * self.local_experts, (rank + 1) * self.local_experts)


def exchange_counts(counts: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Every rank's rows per global expert, [world, experts] on the device (Megatron all-gathers them too)."""
    gathered = counts.new_empty(shape.world * shape.experts)  # flat: gloo takes no [world, n] output
    dist.all_gather_into_tensor(gathered, counts)
    return gathered.view(shape.world, shape.experts)


def reference_dispatch(tokens, sorted_indices, counts, shape: Shape):
    """Megatron's way at EP > 1: host split sizes (a wait), all_to_all_single, split-and-concatenate."""
    rows = tokens.index_select(0, sorted_indices)
    received_counts = exchange_counts(counts, shape)[:, shape.mine]  # [source rank, local expert]
    send_sizes = counts.view(shape.world, shape.local_experts).sum(1).tolist()  # the device-to-host wait
    receive_sizes = received_counts.sum(1).tolist()
    received = rows.new_empty(sum(receive_sizes), shape.hidden)
    dist.all_to_all_single(received, rows, receive_sizes, send_sizes)
    grouped = split_and_concatenate(received, received_counts.flatten(), expert_major_order(shape.world, shape.local_experts))
    return grouped, received_counts, (send_sizes, receive_sizes)


def reference_combine(expert_out, received_counts, sizes, shape: Shape):
    """The way back: regroup [expert, source] -> [source, expert] on host sizes, all_to_all_single."""
    send_sizes, receive_sizes = sizes
    restored = split_and_concatenate(expert_out, received_counts.t().flatten(), source_major_order(shape.world, shape.local_experts))
    back = expert_out.new_empty(shape.rows, shape.hidden)
    dist.all_to_all_single(back, restored, send_sizes, receive_sizes)
    return back


class DevicePath:
    """Dispatch and combine on the 1-D op with every size on the device."""

    def __init__(self, shape: Shape, exchange_class, dtype, device, group_name: str):
        self.shape = shape
        self.dispatch_buffers = exchange_class(shape.rows, shape.capacity, shape.hidden, dtype, device, group_name, shape.world)
        self.combine_buffers = exchange_class(shape.capacity, shape.rows, shape.hidden, dtype, device, group_name, shape.world)
        self.to_experts = expert_major_order(shape.world, shape.local_experts).to(device)
        self.to_sources = source_major_order(shape.world, shape.local_experts).to(device)

    def nbytes(self) -> int:
        return self.dispatch_buffers.nbytes() + self.combine_buffers.nbytes()

    def dispatch(self, tokens, sorted_indices, counts):
        """-> (rows grouped by local expert, then source rank: the first sum(counts) of `capacity` rows
        are data; [source, local expert] counts)."""
        shape, buffers = self.shape, self.dispatch_buffers
        # the counts all-gather is also the barrier: every peer has finished the previous exchange
        # (its pulls from our send buffer) before we refill the buffer below
        received_counts = exchange_counts(counts, shape)[:, shape.mine]
        buffers.in_splits.copy_(counts.view(shape.world, shape.local_experts).sum(1))
        torch.index_select(tokens, 0, sorted_indices, out=buffers.input)  # the permute writes the send buffer
        buffers()
        index = chunk_gather_index(received_counts.flatten(), self.to_experts, shape.capacity)
        return buffers.out.index_select(0, index), received_counts

    def combine(self, expert_out, received_counts):
        """-> this rank's rows back, in its permuted order. No barrier of its own: the dispatch's
        all-gather since the previous combine already orders the buffer reuse."""
        shape, buffers = self.shape, self.combine_buffers
        buffers.in_splits.copy_(received_counts.sum(1))
        index = chunk_gather_index(received_counts.t().flatten(), self.to_sources, shape.capacity)
        torch.index_select(expert_out, 0, index, out=buffers.input)
        buffers()
        return buffers.out


def expert_compute(grouped: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: exact in bf16 (a doubling), so combine parity stays bitwise."""
    return grouped * 2


# ---------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------


def sync_debug_check(fn) -> dict:
    """Run `fn` with CUDA's sync debug mode at 'error': whether a host sync was attempted, and where."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        result = {"host_sync": False}
    except RuntimeError as error:
        result = {"host_sync": True, "error": str(error).splitlines()[0][:300],
                  "at": [line.strip() for line in traceback.format_exc().splitlines() if line.strip().startswith("File")][-3:]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    dist.barrier()
    return result


def host_runs_ahead(fn, busy_ms: float = 100.0) -> dict:
    """Queue `busy_ms` of GPU sleep, then `fn`: if the host returns long before the sleep ends, `fn` did
    not wait for the device (this sees waits outside torch's sync check too)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * busy_ms / max(start.elapsed_time(end), 1e-3))
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(cycles)
    began = time.perf_counter()
    fn()
    queued_ms = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    done_ms = (time.perf_counter() - began) * 1e3
    dist.barrier()
    return {"busy_ms": busy_ms, "host_queued_ms": round(queued_ms, 3), "device_done_ms": round(done_ms, 3),
            "ran_ahead": queued_ms < 0.5 * busy_ms}


def median_ms(fn, repeats: int, inner: int, distributed: bool = True) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if distributed:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return round(statistics.median(times), 4)


def scatter_micro_times(shape: Shape, device, repeats: int, inner: int) -> dict:
    """index_add_ / scatter_add_ (top-k duplicates, atomics) against gather by inverse order + sum over k."""
    routing = draw_routing(shape.tokens, shape.topk, shape.experts, seed=1234, device=device)
    flat_sorted, sorted_indices, _ = permutation_of(routing, shape.experts)
    token_rows = token_rows_of(flat_sorted, routing, shape.experts)
    grad_rows = torch.randn(shape.rows, shape.hidden, dtype=torch.bfloat16, device=device)
    tokens = torch.randn(shape.tokens, shape.hidden, dtype=torch.bfloat16, device=device)
    expanded = sorted_indices.unsqueeze(1).expand(-1, shape.hidden)

    def index_add():
        return torch.zeros(shape.tokens, shape.hidden, dtype=torch.bfloat16, device=device).index_add_(0, sorted_indices, grad_rows)

    def scatter_add():
        return torch.zeros(shape.tokens, shape.hidden, dtype=torch.bfloat16, device=device).scatter_add_(0, expanded, grad_rows)

    exact = torch.zeros(shape.tokens, shape.hidden, dtype=torch.float64, device=device).index_add_(0, sorted_indices, grad_rows.double())
    errors = {name: float((fn().double() - exact).abs().max())
              for name, fn in (("index_add", index_add), ("scatter_add", scatter_add), ("gather_sum", lambda: gather_sum(grad_rows, token_rows)))}
    return {
        "shape": {"tokens": shape.tokens, "topk": shape.topk, "hidden": shape.hidden, "experts": shape.experts},
        "permute_index_select_ms": median_ms(lambda: tokens.index_select(0, sorted_indices), repeats, inner, False),
        "index_add_ms": median_ms(index_add, repeats, inner, False),
        "scatter_add_ms": median_ms(scatter_add, repeats, inner, False),
        "gather_sum_ms": median_ms(lambda: gather_sum(grad_rows, token_rows), repeats, inner, False),
        "inverse_order_ms": median_ms(lambda: token_rows_of(flat_sorted, routing, shape.experts), repeats, inner, False),
        "max_abs_error_vs_fp64": errors,
    }


# ---------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------


def parity(shape: Shape, path: DevicePath, tokens, sorted_indices, counts, device) -> dict:
    """Both paths once on the same inputs; every comparison bitwise."""
    from skyrl_megatron.model.moe.token_sort import chunk_order_rows

    for buffer in (path.dispatch_buffers.out, path.combine_buffers.out):
        buffer.fill_(float("nan"))  # stale rows cannot pass
    grouped_ref, counts_ref, sizes = reference_dispatch(tokens, sorted_indices, counts, shape)
    back_ref = reference_combine(expert_compute(grouped_ref), counts_ref, sizes, shape)
    grouped, received_counts = path.dispatch(tokens, sorted_indices, counts)
    landed_splits_offsets = path.dispatch_buffers.out_splits_offsets.clone()
    back = path.combine(expert_compute(grouped), received_counts)
    received = sum(sizes[1])
    per_source = received_counts.sum(1)
    index = chunk_gather_index(received_counts.flatten(), path.to_experts, shape.capacity)
    return {
        "received_rows": received,
        "capacity_rows": shape.capacity,
        "counts_equal": bool(torch.equal(received_counts, counts_ref)),
        "op_splits_offsets_equal": bool(torch.equal(landed_splits_offsets[0], per_source)
                                        and torch.equal(landed_splits_offsets[1], torch.cumsum(per_source, 0) - per_source)),
        "regroup_index_equals_chunk_order_rows": bool(torch.equal(
            index[:received], chunk_order_rows(received_counts.flatten(), path.to_experts, received))),
        "dispatch_equal": bool(torch.equal(grouped[:received], grouped_ref)),
        "combine_equal": bool(torch.equal(back, back_ref)),
        "round_trip_equal": bool(torch.equal(back, expert_compute(tokens.index_select(0, sorted_indices)))),
    }


PARITY_KEYS = ("counts_equal", "op_splits_offsets_equal", "regroup_index_equals_chunk_order_rows",
               "dispatch_equal", "combine_equal", "round_trip_equal")


def try_2d(shape: Shape, path: DevicePath, counts, grouped_ref, device, group_name: str) -> dict:
    """The 2-D op at this shape, as one reported case (session 17: refused at 64 local experts)."""
    import torch.distributed._symmetric_memory as symm_mem

    in_splits = symm_mem.empty(shape.experts, dtype=torch.int64, device=device)
    landed = symm_mem.empty(2, shape.experts, dtype=torch.int64, device=device)
    for buffer in (in_splits, landed):
        symm_mem.rendezvous(buffer, group_name)
    in_splits.copy_(counts)
    buffers = path.dispatch_buffers
    torch.cuda.synchronize()
    dist.barrier()
    try:
        torch.ops.symm_mem.all_to_all_vdev_2d(buffers.input, buffers.out, in_splits, landed, group_name, major_align=1)
        torch.cuda.synchronize()
    except RuntimeError as error:
        dist.barrier()
        return {"ran": False, "error": str(error).splitlines()[0][:300]}
    rows = torch.cat([torch.arange(start, start + size, device=device) for size, start in zip(landed[0].tolist(), landed[1].tolist())])
    dist.barrier()
    return {"ran": True, "dispatch_equal": bool(rows.numel() == grouped_ref.shape[0]
                                                 and torch.equal(buffers.out.index_select(0, rows), grouped_ref))}


def run_rank(rank: int, world: int, args, result_file: str) -> None:
    smoke = args.smoke
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if smoke:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    report: dict = {"rank": rank, "torch": torch.__version__, "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(rank)}
    shape = Shape(args, world, rank)
    group_name = dist.group.WORLD.group_name
    if smoke:
        exchange_class = EmulatedExchange
    else:
        import torch.distributed._symmetric_memory as symm_mem

        # first, as it needs no communication: kept in the partial report if the exchange fails later
        report["scatter_micro"] = scatter_micro_times(shape, device, args.repeats, args.inner)
        _save_partial(report, result_file, rank)
        report["nvshmem_available"] = symm_mem.is_nvshmem_available()
        if not report["nvshmem_available"]:
            _finish(report, rank, world, result_file)
            return
        symm_mem.set_backend("NVSHMEM")
        exchange_class = VdevExchange

    routing = draw_routing(shape.tokens, shape.topk, shape.experts, seed=args.seed + rank, device=device)
    _, sorted_indices, counts = permutation_of(routing, shape.experts)
    dtype = torch.float32 if smoke else torch.bfloat16  # gloo's all-to-all is not asked for bf16
    generator = torch.Generator(device=device).manual_seed(args.seed + 100 + rank)
    tokens = torch.randn(shape.tokens, shape.hidden, generator=generator, device=device).to(dtype)

    free_before = None if smoke else torch.cuda.mem_get_info(device)[0]
    path = DevicePath(shape, exchange_class, dtype, device, group_name)
    report["symmetric_buffers"] = {
        "bytes": path.nbytes(),
        "GiB": round(path.nbytes() / 2**30, 3),
        "device_free_drop_GiB": None if smoke else round((free_before - torch.cuda.mem_get_info(device)[0]) / 2**30, 3),
        "layout": "dispatch send rows x hidden, dispatch receive capacity x hidden, combine send capacity x hidden,"
                  " combine receive rows x hidden, and four small split tensors",
    }
    dist.barrier()
    _save_partial(report, result_file, rank)

    report["parity"] = parity(shape, path, tokens, sorted_indices, counts, device)
    _save_partial(report, result_file, rank)
    report.update(tokens=shape.tokens, topk=shape.topk, hidden=shape.hidden, experts=shape.experts, world=world,
                  rows_per_rank=shape.rows)

    if not smoke:
        def device_round_trip():
            grouped, received_counts = path.dispatch(tokens, sorted_indices, counts)
            return path.combine(expert_compute(grouped), received_counts)

        def reference_round_trip():
            grouped, received_counts, sizes = reference_dispatch(tokens, sorted_indices, counts, shape)
            return reference_combine(expert_compute(grouped), received_counts, sizes, shape)

        device_round_trip()  # warm: team set-up, NCCL
        report["host_sync"] = {"device_path": sync_debug_check(device_round_trip),
                               "reference_path": sync_debug_check(reference_round_trip)}
        report["host_runs_ahead"] = {"device_path": host_runs_ahead(device_round_trip),
                                     "reference_path": host_runs_ahead(reference_round_trip)}
        _save_partial(report, result_file, rank)

        # time, each path behind a matrix product (a model's attention and router would be there)
        weight = torch.randn(shape.hidden, shape.hidden, dtype=torch.bfloat16, device=device)
        activations = torch.randn(shape.tokens, shape.hidden, dtype=torch.bfloat16, device=device)
        cases = {
            "reference_dispatch": lambda: reference_dispatch(tokens, sorted_indices, counts, shape),
            "device_dispatch": lambda: path.dispatch(tokens, sorted_indices, counts),
            "reference_round_trip": reference_round_trip,
            "device_round_trip": device_round_trip,
        }
        timing = {"matmul_alone": median_ms(lambda: activations @ weight, args.repeats, args.inner)}
        for name, fn in cases.items():
            timing[name] = median_ms(lambda fn=fn: (activations @ weight, fn()), args.repeats, args.inner)
        timing["round_trip_speedup"] = round(timing["reference_round_trip"] / timing["device_round_trip"], 3)
        report["timing_ms"] = timing
        _save_partial(report, result_file, rank)
        grouped_ref, _, _ = reference_dispatch(tokens, sorted_indices, counts, shape)
        report["vdev_2d"] = try_2d(shape, path, counts, grouped_ref, device, group_name)
        report["env"] = {key: os.environ.get(key) for key in (*SAFE_ENV, "NVSHMEM_SYMMETRIC_SIZE")}
    _finish(report, rank, world, result_file)


def _partial_path(result_file: str, rank: int) -> Path:
    return Path(result_file).with_name(Path(result_file).name + f".rank{rank}.partial")


def _save_partial(report: dict, result_file: str, rank: int) -> None:
    """This rank's report so far: what survives if a later stage fails or hangs."""
    _partial_path(result_file, rank).write_text(json.dumps(report, indent=1))


def _finish(report: dict, rank: int, world: int, result_file: str) -> None:
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(result_file).write_text(json.dumps({"ranks": gathered}, indent=1))
    dist.barrier()
    _partial_path(result_file, rank).unlink(missing_ok=True)
    dist.destroy_process_group()


def summarize(result: dict) -> tuple[int, list[str]]:
    """Exit code and a few lines for the log."""
    ranks = result["ranks"]
    if not all(r.get("nvshmem_available", True) for r in ranks):
        return 2, ["NVSHMEM is not available to this torch build"]
    ok = all(r["parity"][key] for r in ranks for key in PARITY_KEYS)
    lines = [f"parity ({', '.join(PARITY_KEYS)}): {'all hold' if ok else 'MISMATCH'}"]
    for r in ranks:
        failed = [key for key in PARITY_KEYS if not r["parity"][key]]
        lines.append(f"  rank {r['rank']}: received {r['parity']['received_rows']} of {r['parity']['capacity_rows']} rows"
                     + (f"; failed: {failed}" if failed else ""))
    first = ranks[0]
    if "timing_ms" in first:
        t = first["timing_ms"]
        lines.append(f"rank 0 ms: dispatch reference {t['reference_dispatch']} / device {t['device_dispatch']}; round trip "
                     f"reference {t['reference_round_trip']} / device {t['device_round_trip']} (x{t['round_trip_speedup']})")
        lines.append("host sync in the device path: " + str([r["host_sync"]["device_path"]["host_sync"] for r in ranks])
                     + ", reference path: " + str([r["host_sync"]["reference_path"]["host_sync"] for r in ranks]))
        lines.append(f"symmetric buffers: {first['symmetric_buffers']['GiB']} GiB per rank")
        s = first["scatter_micro"]
        lines.append(f"one GPU: index_add_ {s['index_add_ms']} ms, scatter_add_ {s['scatter_add_ms']} ms, gather+sum "
                     f"{s['gather_sum_ms']} ms (inverse order {s['inverse_order_ms']} ms)")
        lines.append(f"2-D op: {first['vdev_2d']}")
    return (0 if ok else 1), lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_moe_shape_arguments(parser, tokens=8192)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, small shape; the NVSHMEM op emulated")
    parser.add_argument("--out", type=Path, default=Path("symm_mem_a2a.json"))
    args = parser.parse_args(argv)
    world = WORLD
    if args.smoke:
        args.tokens, args.topk, args.hidden, args.experts = min(args.tokens, 96), min(args.topk, 4), min(args.hidden, 16), min(args.experts, 8)
    elif torch.cuda.device_count() < world:
        parser.error(f"needs {world} GPUs of one host")
    elif (args.hidden * 2) % 32:
        parser.error("the 1-D op splits each peer's bytes over up to 32 blocks exactly: hidden * 2 bytes must be a multiple of 32")
    try:
        launch_ranks(run_rank, args, str(args.out), smoke=args.smoke)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        # keep what each rank had measured, and the error, in --out
        partial = [_partial_path(str(args.out), rank) for rank in range(world)]
        ranks = [json.loads(p.read_text()) if p.exists() else None for p in partial]
        args.out.write_text(json.dumps({"error": str(error)[-4000:], "ranks": ranks}, indent=1))
        print(str(error)[-4000:], file=sys.stderr)
        print(f"a rank failed (exit 3); partial reports in {args.out}")
        return 3
    code, lines = summarize(json.loads(args.out.read_text()))
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
