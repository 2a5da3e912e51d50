"""flash-attn-4 as our core attention's segment kernel (`megatron_config.attention_kernel=flash4`)
against `varlen` (torch's varlen_attn, FlashAttention-2) and an fp32 reference, on one Hopper or
Blackwell GPU, through our own code:

1. `CoreAttention` (model/layers/attention.py) on packed THD micro-batches: 8,192 tokens of RL-like lengths
   (a ~256-token prompt plus a log-uniform response of 64-4096), Qwen3-4B heads (32 query heads,
   8 or 32 key/value heads, head dim 128), bf16; built with attention_kernel=flash4 and =varlen (and
   what `auto` picks here, recorded). Errors of the output and of the query/key/value gradients against
   fp32 attention per sequence; forward and forward + backward device milliseconds.
2. The context-parallel segments at CP 2 on one GPU: each rank's local queries against K/V gathered
   rank-major, through `context_parallel_segments` + `attend_segments` (queries shorter than keys,
   bottom-right aligned). Errors against fp32 attention over the same segments (output and
   gradients) and against fp32 attention over the whole sequences (the layout and the kernel
   together); times.
3. The first call on new sequence lengths, per kernel: a recompile would show as a slow first call.

A check passes when flash4's largest error is at most twice varlen's plus 1e-3 (both are bf16
kernels; the reference is fp32). Exit status 0: all passed; 1: one failed; 2: flash4 cannot run here.
Not a CI test: it needs a GPU and flash-attn-4. On the lent machine (bench/device_setup.sh, calls 1-4):

    source bench/device_setup.sh 4 && python bench/gpu_fa4_check.py --out $OUT/fa4_check.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from skyrl_megatron.attention_kernels import SegmentKernel
from skyrl_megatron.model.layers.attention import (
    AttentionKernelError,
    CausalSegments,
    CoreAttention,
    attend_segments,
    context_parallel_segments,
    select_segment_kernel,
)
from skyrl_megatron.model.layers.context_parallel_layout import context_parallel_index
from skyrl_megatron.runtime import activate_runtime

DEVICE = "cuda"
HEADS, HEAD_DIM = 32, 128
SCALE = HEAD_DIM**-0.5
KERNELS = ("flash4", "varlen")


def rl_lengths(total: int, seed: int, multiple: int = 4) -> list[int]:
    """Sequence lengths summing to `total`, each a multiple of `multiple` (2 x CP, as packing pads them)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        response = math.exp(torch.empty(1).uniform_(math.log(64), math.log(4096), generator=generator).item())
        length = max(multiple, int(256 + response) // multiple * multiple)
        lengths.append(min(length, total - sum(lengths)))
    return lengths


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)


def reference(query, key, value, segments: CausalSegments):
    """fp32 attention per segment (bottom-right causal mask), PyTorch's math kernel; autograd-capable."""
    if segments.key_index is not None:
        key, value = key.index_select(0, segments.key_index), value.index_select(0, segments.key_index)
    repeat = query.shape[1] // key.shape[1]
    cu_q, cu_k = segments.cu_seqlens_q.tolist(), segments.cu_seqlens_k.tolist()
    outputs = []
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(len(cu_q) - 1):
            q = query[cu_q[i] : cu_q[i + 1]].float().transpose(0, 1)
            k, v = (x[cu_k[i] : cu_k[i + 1]].float().repeat_interleave(repeat, 1).transpose(0, 1) for x in (key, value))
            q_len, k_len = q.shape[1], k.shape[1]
            positions = torch.arange(k_len, device=q.device)
            mask = positions[None, :] <= positions[k_len - q_len :, None]
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE).transpose(0, 1))
    return torch.cat(outputs)


def with_grads(fn, inputs, grad, dtype=None):
    """fn on fresh leaves (cast to `dtype` if given): the output and the leaves' gradients for `grad`."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return out.detach(), [leaf.grad for leaf in leaves]


def errors(result, truth) -> dict:
    (out, grads), (ref_out, ref_grads) = result, truth
    return {
        "output": (out.float() - ref_out.float()).abs().max().item(),
        "grad": max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref_grads)),
    }


def device_ms(fn, inputs, grad, backward: bool, repeats: int = 20) -> float:
    """Median device milliseconds (CUDA events) of fn (and its backward), after 3 warm-up calls."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def call():
        out = fn(*leaves)
        if backward:
            out.backward(grad)

    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, inputs, grad) -> float:
    """One forward + backward, host clock to device completion (includes any compile)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn(*leaves).backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def core_attention(kernel: str, groups: int) -> CoreAttention:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, kv_channels=HEAD_DIM, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, bf16=True)
    # one GPU, no CP group: the packed path without the K/V all-gather
    return CoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=types.SimpleNamespace(cp=None),
                         attention_kernel=kernel)


def qkv(tokens: int, groups: int, seed: int):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(tokens, heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=generator)
            for heads in (HEADS, groups, groups)]


def module_check(tokens: int, groups: int, seed: int) -> dict:
    """CoreAttention on one packed micro-batch, each kernel against fp32."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = rl_lengths(tokens, seed)
    cu = cumulative(lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    inputs = qkv(tokens, groups, seed)
    grad = torch.randn(tokens, HEADS * HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                       generator=torch.Generator(device=DEVICE).manual_seed(seed + 1))
    segments = CausalSegments(cu, cu, max(lengths), max(lengths))
    truth = with_grads(lambda q, k, v: reference(q, k, v, segments).reshape(tokens, -1), inputs, grad, torch.float32)
    result = {"sequences": len(lengths), "max_len": max(lengths), "kv_heads": groups,
              "auto_picks": core_attention("auto", groups).segment_kernel.value}
    for kernel in KERNELS:
        module = core_attention(kernel, groups)
        assert module.segment_kernel.value == kernel, (module.segment_kernel, kernel)

        def call(q, k, v, module=module):
            return module(q, k, v, None, packed_seq_params=params)

        first = wall_ms(call, inputs, grad)  # flash4: compiles its kernels for this configuration
        result[kernel] = {
            **errors(with_grads(call, inputs, grad), truth),
            "first_call_ms": first,
            "fwd_ms": device_ms(call, inputs, grad, backward=False),
            "fwd_bwd_ms": device_ms(call, inputs, grad, backward=True),
        }
    return result


def context_parallel_check(tokens: int, groups: int, seed: int, cp_size: int = 2) -> dict:
    """Each CP rank's segments (local queries, K/V gathered rank-major) through attend_segments."""
    lengths = rl_lengths(tokens, seed, multiple=2 * cp_size)
    q, k, v = qkv(tokens, groups, seed)
    full = CausalSegments(cumulative(lengths), cumulative(lengths), max(lengths), max(lengths))
    with torch.no_grad():
        whole = reference(q, k, v, full)  # the unsplit attention, fp32
    local = [context_parallel_index(lengths, rank, cp_size).to(DEVICE) for rank in range(cp_size)]
    k_all, v_all = (torch.cat([x[index] for index in local]) for x in (k, v))
    result = {"sequences": len(lengths), "max_len": max(lengths), "kv_heads": groups, "cp": cp_size, "ranks": []}
    for rank, index in enumerate(local):
        segments = context_parallel_segments(tuple(lengths), rank, cp_size, torch.device(DEVICE))
        inputs = [q[index], k_all, v_all]
        grad = torch.randn(index.numel(), HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                           generator=torch.Generator(device=DEVICE).manual_seed(seed + rank))
        truth = with_grads(lambda q_, k_, v_: reference(q_, k_, v_, segments), inputs, grad, torch.float32)
        row = {"rank": rank, "queries": index.numel(), "keys": int(segments.cu_seqlens_k[-1])}
        for kernel in KERNELS:
            kind = SegmentKernel(kernel)

            def call(q_, k_, v_, segments=segments, kind=kind):
                return attend_segments(q_, k_, v_, segments, SCALE, kind)

            out, grads = with_grads(call, inputs, grad)
            row[kernel] = {
                **errors((out, grads), truth),
                "output_vs_whole_sequences": (out.float() - whole[index]).abs().max().item(),
                "fwd_ms": device_ms(call, inputs, grad, backward=False),
                "fwd_bwd_ms": device_ms(call, inputs, grad, backward=True),
            }
        result["ranks"].append(row)
    return result


def first_calls(tokens: int, groups: int, seeds: range) -> dict:
    """The first and second forward + backward on each new set of lengths (a recompile: a slow first)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    result = {}
    for kernel in KERNELS:
        module = core_attention(kernel, groups)
        rows = []
        for seed in seeds:
            lengths = rl_lengths(tokens, seed)
            cu = cumulative(lengths)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
            inputs = qkv(tokens, groups, seed)
            grad = torch.randn(tokens, HEADS * HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)

            def call(q, k, v, module=module, params=params):
                return module(q, k, v, None, packed_seq_params=params)

            rows.append({"sequences": len(lengths), "first_ms": round(wall_ms(call, inputs, grad), 2),
                         "second_ms": round(wall_ms(call, inputs, grad), 2)})
        result[kernel] = rows
    return result


def verdicts(report: dict) -> list[str]:
    """The checks that failed: flash4's errors above twice varlen's plus 1e-3."""
    failed = []

    def compare(name: str, row: dict, fields: tuple[str, ...]) -> None:
        for field in fields:
            bound = 2 * row["varlen"][field] + 1e-3
            ok = row["flash4"][field] <= bound
            print(f"{'PASS' if ok else 'FAIL'} {name} {field}: flash4 {row['flash4'][field]:.3g}, "
                  f"varlen {row['varlen'][field]:.3g} (bound {bound:.3g})", flush=True)
            if not ok:
                failed.append(f"{name} {field}")

    for row in report["module"]:
        compare(f"CoreAttention THD kv{row['kv_heads']} ({row['sequences']} seqs)", row, ("output", "grad"))
    for case in report["context_parallel"]:
        for row in case["ranks"]:
            compare(f"CP{case['cp']} rank {row['rank']} kv{case['kv_heads']}", row,
                    ("output", "grad", "output_vs_whole_sequences"))
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fa4_check.json")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    runtime = activate_runtime("cuda")
    try:
        select_segment_kernel(runtime, torch.bfloat16, "flash4")
    except AttentionKernelError as exc:
        print(f"gpu_fa4_check: flash4 cannot run here: {exc}", flush=True)
        return 2
    report = {
        "device": torch.cuda.get_device_name(0),
        "capability": "sm%d%d" % torch.cuda.get_device_capability(0),
        "torch": torch.__version__,
        "flash_attn_4": importlib.metadata.version("flash-attn-4"),
        "date": time.strftime("%Y-%m-%d"),
        "tokens": args.tokens,
        "module": [],
        "context_parallel": [],
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    for groups in (8, HEADS):
        for seed in (0, 1):
            row = module_check(args.tokens, groups, seed)
            print("module", json.dumps(row), flush=True)
            report["module"].append(row)
            save()
        row = context_parallel_check(args.tokens, groups, seed=2)
        print("context_parallel", json.dumps(row), flush=True)
        report["context_parallel"].append(row)
        save()
    report["first_call"] = first_calls(args.tokens, 8, range(10, 16))
    print("first_call", json.dumps(report["first_call"]), flush=True)
    report["failed"] = verdicts(report)
    for row in report["module"]:
        print(f"TIME CoreAttention THD kv{row['kv_heads']} {row['sequences']} seqs: fwd+bwd flash4 "
              f"{row['flash4']['fwd_bwd_ms']:.3f} ms vs varlen {row['varlen']['fwd_bwd_ms']:.3f} ms; fwd "
              f"{row['flash4']['fwd_ms']:.3f} vs {row['varlen']['fwd_ms']:.3f} ms (auto picks {row['auto_picks']})")
    save()
    print(f"gpu_fa4_check on {report['device']}: {'all passed' if not report['failed'] else 'FAILED ' + str(report['failed'])}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
