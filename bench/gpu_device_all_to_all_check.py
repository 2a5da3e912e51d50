"""The product's device-side MoE exchange (model/moe/device_all_to_all.py over model/moe/row_exchange.py's
`NvshmemExchange`) on 2 GPUs: parity with the host-split path, forward and backward, over several
layers; no host sync; the symmetric buffers' reuse and growth.

The composition (torch's 1-D NVSHMEM all-to-all, then one on-device gather) was first validated on one forward
exchange each way (docs/benchmarks.md, "MoE checks"). This runs what the MoE layer runs
(`moe_config.device_all_to_all`): `dispatch` / `combine` as autograd functions, for tokens (bf16)
and routing probabilities (fp32, moved as bf16 words padded to the op's 32-byte rows inside the transport), for
--layers layers forward and then backward, so each symmetric buffer set is reused in the order a
training step uses it, plus two exchanges in a row on the same buffers (the queued barrier) and a
larger micro-batch after a smaller one (buffer growth). Reported per rank:
1. parity, bitwise, against host split sizes + `all_to_all_single` (differentiable) + split-and-
   concatenate regrouping: every layer's expert-side tokens and probabilities, the outputs, and the
   gradients of tokens and probabilities;
2. whether a forward and backward of one layer's exchange makes a host sync (CUDA's sync debug
   mode at 'error'), the reference path checked the same way;
3. time of one layer's dispatch + combine, forward and backward, both paths (median, CUDA events).
Exit 0 when every parity check holds, 1 on a mismatch, 2 without NVSHMEM.

    python3 bench/gpu_device_all_to_all_check.py --out FILE       # 2 GPUs, plain torch, about 1 min
    python3 bench/gpu_device_all_to_all_check.py --smoke --out FILE   # CPU, gloo, the op emulated
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # two_gpu_launch, when imported by the tests

from skyrl_megatron.model.moe.device_all_to_all import ExchangePlan, combine, dispatch  # noqa: E402
from skyrl_megatron.model.moe.row_exchange import EmulatedExchange, NvshmemExchange  # noqa: E402
from skyrl_megatron.model.moe.token_sort import expert_major_order, source_major_order  # noqa: E402
from skyrl_megatron.testing.reference_exchange import host_splits_all_to_all, split_and_concatenate  # noqa: E402
from cuda_timing import median_event_ms  # noqa: E402
from two_gpu_launch import WORLD, add_moe_shape_arguments, launch_ranks  # noqa: E402

# NVLink multicast stays off on the lent machines (shared GPUs); set before NCCL or NVSHMEM start.


def _routing(rows: int, experts: int, seed: int, device) -> torch.Tensor:
    """Rows per global expert, uneven (skewed), summing to `rows`, the last expert without any."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 0.7
    weights = weights[torch.randperm(experts, generator=g)]
    weights[-1] = 0
    return torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=g), minlength=experts).to(device)


class Layer:
    """One MoE layer's routing on this rank: the plan (device) and the host sizes (reference)."""

    def __init__(self, exchange, counts, world: int, rank: int, local_experts: int):
        gathered = counts.new_empty(world * counts.numel())
        dist.all_gather_into_tensor(gathered, counts)
        mine = slice(rank * local_experts, (rank + 1) * local_experts)
        self.received = gathered.view(world, -1)[:, mine].contiguous()
        rows = int(counts.sum())
        self.plan = ExchangePlan(exchange, counts.view(world, local_experts).sum(1), self.received, rows=rows,
                                 capacity=rows * world)
        self.send_sizes = counts.view(world, local_experts).sum(1).tolist()
        self.receive_sizes = self.received.sum(1).tolist()
        self.total = sum(self.receive_sizes)
        self.to_experts = expert_major_order(world, local_experts)
        self.to_sources = source_major_order(world, local_experts)

    def reference_dispatch(self, rows):
        landed = host_splits_all_to_all(rows, self.receive_sizes, self.send_sizes)
        return split_and_concatenate(landed, self.received.flatten(), self.to_experts)

    def reference_combine(self, rows):
        by_source = split_and_concatenate(rows, self.received.t().flatten(), self.to_sources)
        return host_splits_all_to_all(by_source, self.send_sizes, self.receive_sizes)


def _expert(tokens, probs):
    """A stand-in expert weighting each row by its probability (as the experts' activation does): row-wise,
    so both paths compute it on the same rows alike, and gradients reach tokens and probabilities."""
    return tokens * probs.unsqueeze(-1).to(tokens.dtype)


def _step(layers, tokens, probs, device_path: bool):
    """Every layer's dispatch, expert, combine (forward), then one backward through all."""
    x = [t.clone().requires_grad_() for t in tokens]
    p = [q.clone().requires_grad_() for q in probs]
    expert_side, outputs = [], []
    for layer, xi, pi in zip(layers, x, p):
        if device_path:
            grouped, grouped_probs = dispatch(xi, layer.plan), dispatch(pi, layer.plan)
            out = combine(_expert(grouped, grouped_probs), layer.plan)
            expert_side.append((grouped[: layer.total].detach(), grouped_probs[: layer.total].detach()))
        else:
            grouped, grouped_probs = layer.reference_dispatch(xi), layer.reference_dispatch(pi)
            out = layer.reference_combine(_expert(grouped, grouped_probs))
            expert_side.append((grouped.detach(), grouped_probs.detach()))
        outputs.append(out)
    # every output and probability takes part, so both kinds of gradient travel back
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outputs)) \
        + sum((layer_probs * (i + 2)).sum() for i, layer_probs in enumerate(p))
    loss.backward()
    return expert_side, [o.detach() for o in outputs], [t.grad for t in x], [q.grad for q in p]


def _parity(layers, tokens, probs) -> dict:
    dev = _step(layers, tokens, probs, True)
    ref = _step(layers, tokens, probs, False)
    names = ("expert_side", "outputs", "token_grads", "prob_grads")
    result = {}
    for name, got, want in zip(names, dev, ref):
        if name == "expert_side":
            result["expert_tokens_equal"] = all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
            result["expert_probs_equal"] = all(torch.equal(a[1], b[1]) for a, b in zip(got, want))
        else:
            result[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    return result


def _sync_check(fn) -> dict:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        result = {"host_sync": False}
    except RuntimeError as error:
        result = {"host_sync": True, "error": str(error).splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    dist.barrier()
    return result


def _median_ms(fn, repeats: int) -> float:
    def line_up() -> None:
        torch.cuda.synchronize()
        dist.barrier()

    return round(median_event_ms(fn, repeats, warmup=3, before=line_up), 4)


def run_rank(rank: int, world: int, args, out_file: str) -> None:
    smoke = args.smoke
    if smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    report: dict = {"rank": rank, "torch": torch.__version__}
    group = dist.group.WORLD
    if not smoke:
        import torch.distributed._symmetric_memory as symm_mem

        report["nvshmem_available"] = bool(symm_mem.is_nvshmem_available())
        if not report["nvshmem_available"]:
            _finish(report, rank, world, out_file)
            return
    exchange = EmulatedExchange(group) if smoke else NvshmemExchange(group)
    dtype = torch.float32 if smoke else torch.bfloat16
    local_experts = args.experts // world
    rows = args.tokens * args.topk

    def make(n_rows: int, seed: int):
        layers, tokens, probs = [], [], []
        for i in range(args.layers):
            layers.append(Layer(exchange, _routing(n_rows, args.experts, seed + 10 * i + rank, device), world, rank, local_experts))
            g = torch.Generator(device=device).manual_seed(seed + 100 * i + rank)
            tokens.append(torch.randn(n_rows, args.hidden, generator=g, device=device).to(dtype))
            probs.append(torch.rand(n_rows, generator=g, device=device) - 0.25)  # fp32, some negative
        return layers, tokens, probs

    small = make(rows // 2, seed=1)  # first a smaller micro-batch: the buffers grow for the next
    report["parity_small"] = _parity(*small)
    layers, tokens, probs = make(rows, seed=2)
    report["parity"] = _parity(layers, tokens, probs)
    # two exchanges in a row on the same buffers (the queued barrier), then parity again
    dispatch(tokens[0], layers[0].plan)
    dispatch(tokens[1], layers[1].plan)
    report["parity_after_back_to_back"] = _parity(layers, tokens, probs)
    report["received_rows"] = [layer.total for layer in layers]
    report["capacity_rows"] = layers[0].plan.capacity
    if not smoke:
        one = ([layers[0]], [tokens[0]], [probs[0]])
        report["host_sync"] = {"device_path": _sync_check(lambda: _step(*one, True)),
                               "reference_path": _sync_check(lambda: _step(*one, False))}
        report["timing_ms_one_layer_fwd_bwd"] = {"device": _median_ms(lambda: _step(*one, True), args.repeats),
                                                 "reference": _median_ms(lambda: _step(*one, False), args.repeats)}
    _finish(report, rank, world, out_file)


def _finish(report: dict, rank: int, world: int, out_file: str) -> None:
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"ranks": gathered}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


PARITY = ("parity_small", "parity", "parity_after_back_to_back")


def summarize(result: dict) -> tuple[int, list[str]]:
    ranks = result["ranks"]
    if not all(r.get("nvshmem_available", True) for r in ranks):
        return 2, ["NVSHMEM is not available to this torch build"]
    failed = [(r["rank"], case, key) for r in ranks for case in PARITY for key, ok in r[case].items() if not ok]
    lines = [f"parity over {len(PARITY)} cases x {len(ranks[0]['parity'])} checks: " + ("all hold" if not failed else f"MISMATCH {failed}")]
    for r in ranks:
        lines.append(f"  rank {r['rank']}: received {r['received_rows']} of {r['capacity_rows']} rows per layer")
        if "host_sync" in r:
            lines.append(f"  host sync: device path {r['host_sync']['device_path']}, reference {r['host_sync']['reference_path']['host_sync']}; "
                         f"one layer fwd+bwd ms: {r['timing_ms_one_layer_fwd_bwd']}")
    return (1 if failed else 0), lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_moe_shape_arguments(parser, tokens=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, small shapes; the NVSHMEM op emulated")
    parser.add_argument("--out", type=Path, default=Path("device_all_to_all.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.topk, args.hidden, args.experts = 24, 4, 8, 8
    elif torch.cuda.device_count() < WORLD:
        parser.error(f"needs {WORLD} GPUs of one host")
    launch_ranks(run_rank, args, str(args.out), smoke=args.smoke)
    code, lines = summarize(json.loads(args.out.read_text()))
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
