"""Scoring passes as CUDA graphs: can our packed forward be captured once and replayed (issue 18, GPU check).

A Qwen3-1.7B scoring pass keeps an H200 busy 70% of its span (session 23's profile of a pass alone): 0.54 s in
the worker against 0.46 s of kernels, the rest host work spread over the layers. A CUDA graph launches a
micro-batch's layers in one call. Before any product code, this check answers on one GPU, with today's model
(our spec, fused kernels, flash-attn-4 where installed, random weights, bf16), whether that can work:

1. capture: one packed forward (embedding -> layers -> final norm; the logprob head stays eager, it reads the
   kept-token count on the host) into a CUDA graph, its inputs padded to a fixed token bucket with a fixed
   number of boundary slots (`pad_to_bucket`: dummy segments of at most `--pad-segment` tokens, then empty
   segments repeating the last offset) and a fixed `max_seqlen`;
2. parity: micro-batches of other layouts, copied into the same static buffers: replayed hidden states of their
   real tokens against the eager, unpadded forward (bitwise, or the largest difference);
3. time: per micro-batch, eager unpadded, eager padded (the padding's cost) and copy + replay (median seconds).

    python bench/gpu_scoring_graph_check.py [--model Qwen3-1.7B] [--tokens 32768] [--out graph.json]
    python bench/gpu_scoring_graph_check.py --smoke   # CPU, tiny model, fp32: step 2 eagerly (padding into
        the bucket leaves the real tokens' hidden states as they were, which the graphs rely on); no capture

Exit status 1 when a check fails (capture raised, or replays differ from eager beyond bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_moe_sync_check import init_single_rank  # noqa: E402  (bench/, beside this file)

SMOKE_SHAPE = dict(model_type="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=256, num_hidden_layers=2, max_position_embeddings=4096,
                   tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# replayed bf16 hidden states may differ from eager where a GEMM picks another tile for the padded row count
BF16_TOLERANCE = 0.05


def pad_to_bucket(ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, bucket_tokens: int,
                  boundary_slots: int, pad_segment: int, pad_token_id: int = 0):
    """A packed micro-batch (ids, positions [1, T]; cu_seqlens [n + 1]) padded to `bucket_tokens` tokens and
    `boundary_slots` + 1 boundaries: dummy segments of at most `pad_segment` tokens after the real ones (their
    attention costs about `pad_segment` keys per padded token), then empty segments repeating the last offset.
    Returns (ids, positions, cu_seqlens), same dtypes and device."""
    real = ids.shape[1]
    pad = bucket_tokens - real
    if pad < 0:
        raise ValueError(f"{real} tokens do not fit a bucket of {bucket_tokens}")
    dummy = [pad_segment] * (pad // pad_segment) + ([pad % pad_segment] if pad % pad_segment else [])
    segments = cu_seqlens.numel() - 1 + len(dummy)
    if segments > boundary_slots:
        raise ValueError(f"{segments} segments do not fit {boundary_slots} boundary slots")
    device = ids.device
    dummy_lengths = torch.tensor(dummy, dtype=cu_seqlens.dtype, device=device)
    offsets = real + dummy_lengths.cumsum(0, dtype=cu_seqlens.dtype)
    unused = cu_seqlens.new_full((boundary_slots - segments,), bucket_tokens)
    padded_cu = torch.cat([cu_seqlens, offsets, unused])
    padded_ids = torch.cat([ids, ids.new_full((1, pad), pad_token_id)], dim=1)
    dummy_positions = [torch.arange(n, dtype=positions.dtype, device=device) for n in dummy]
    padded_positions = torch.cat([positions, *(p.unsqueeze(0) for p in dummy_positions)], dim=1)
    return padded_ids, padded_positions, padded_cu


def _hidden_only(*, hidden_states, **_unused):
    """An output processor: the final norm's output, no head."""
    return hidden_states


def build(config, dtype: str):
    """Config-only model (random weights) through our spec, as the policy builds it (no DDP: scoring only)."""
    from skyrl_megatron.model.build import ModelSpec, install_patches, make_provider
    from skyrl_megatron.model.conversion.bridge_import import import_bridge
    from skyrl_megatron.runtime import current_runtime

    spec = ModelSpec("<config only>", dtype=dtype, load_weights=False)
    install_patches(spec, current_runtime())
    provider = make_provider(spec, import_bridge().AutoBridge.from_hf_config(config))
    (chunk,) = provider.provide_distributed_model(wrap_with_ddp=False, bf16=dtype == "bf16")
    return chunk.eval()


def _packed_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def _seconds(fn, sync, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen3-1.7B", help="a dense shape in examples/megatron/model_configs")
    parser.add_argument("--tokens", type=int, default=32768, help="the bucket: tokens of a scoring micro-batch")
    parser.add_argument("--pad-segment", type=int, default=128, help="the longest dummy segment of the padding")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager only (checks the script)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    on_gpu = not args.smoke
    if on_gpu and not torch.cuda.is_available():
        parser.error("no GPU: use --smoke for the CPU check of this script")
    device = torch.device("cuda" if on_gpu else "cpu")
    init_single_rank(device.type)

    from transformers import AutoConfig

    from skyrl_megatron.compute.microbatch.pipeline import prepare_micro_batches
    from skyrl_megatron.compute.microbatch.plan import MicroBatching
    from skyrl_megatron.model.layers import rope
    from skyrl_megatron.parallel import ParallelConfig

    if on_gpu:
        import policy_bench  # bench/, beside this file: the published shapes and the bench's RL batch

        config = policy_bench.model_config(args.model)
        batch = policy_bench.rl_batch(policy_bench.BatchShape(), config.vocab_size, 0)
        budget, dtype = args.tokens, "bf16"
    else:
        from skyrl_megatron.testing.rl_batches import make_rl_batch

        config = AutoConfig.for_model(**SMOKE_SHAPE)
        batch = make_rl_batch(12, 16, 48, vocab_size=SMOKE_SHAPE["vocab_size"], seed=1)
        budget, dtype = 256, "fp32"
    config.architectures = [{"qwen3": "Qwen3ForCausalLM"}[config.model_type]]  # the bridge picks by architecture
    model = build(config, dtype)
    micro_batches = prepare_micro_batches(batch["sequences"], batch["attention_mask"],
                                          MicroBatching(max_tokens=budget, packed=True), ParallelConfig(),
                                          device=device).micro_batches
    layouts = [(mb.model_input_ids, mb.model_position_ids, mb.inputs.packed_seq_params) for mb in micro_batches]
    longest = max(int(p.max_seqlen_q) for _, _, p in layouts)
    max_seqlen = max(longest, args.pad_segment)
    slots = max(p.cu_seqlens_q.numel() - 1 for _, _, p in layouts) + -(-budget // args.pad_segment)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    out: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": args.model if on_gpu else "smoke",
                 "bucket_tokens": budget, "pad_segment": args.pad_segment, "boundary_slots": slots,
                 "max_seqlen": max_seqlen, "micro_batches": [], "ok": True}

    def forward(ids, positions, params):
        return model(ids, positions, None, packed_seq_params=params, output_processor=_hidden_only)

    graph, static = None, None
    if on_gpu:
        first_ids, first_positions, first_params = layouts[0]
        static_ids, static_positions, static_cu = pad_to_bucket(first_ids, first_positions, first_params.cu_seqlens_q,
                                                                budget, slots, args.pad_segment)
        static = (static_ids, static_positions, static_cu, _packed_params(static_cu, max_seqlen))
        try:
            with torch.no_grad():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):  # compiles the generated kernels and flash-attn-4's before capture
                        rope._TABLES.clear()
                        forward(*static[:2], static[3])
                torch.cuda.current_stream().wait_stream(side)
                rope._TABLES.clear()  # the rotation tables must be computed inside the graph, not taken from a cache
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = forward(*static[:2], static[3])
                rope._TABLES.clear()
            out["capture"] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - what stops a capture is the finding
            out["capture"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                              "where": traceback.format_exc().splitlines()[-12:]}
            out["ok"], graph = False, None

    for ids, positions, params in layouts:
        real = ids.shape[1]
        padded_ids, padded_positions, padded_cu = pad_to_bucket(ids, positions, params.cu_seqlens_q, budget, slots,
                                                                args.pad_segment)
        padded_params = _packed_params(padded_cu, max_seqlen)
        with torch.no_grad():
            eager = forward(ids, positions, params)
            padded = forward(padded_ids, padded_positions, padded_params)
        row = {"real_tokens": real, "segments": params.cu_seqlens_q.numel() - 1,
               "padded_vs_eager_max_abs": float((padded[:real].float() - eager.float()).abs().max()),
               "padded_vs_eager_bitwise": bool(torch.equal(padded[:real], eager))}
        if graph is not None:
            def replay():
                static[0].copy_(padded_ids)
                static[1].copy_(padded_positions)
                static[2].copy_(padded_cu)
                graph.replay()

            replay()
            sync()
            row["replay_vs_eager_max_abs"] = float((static_out[:real].float() - eager.float()).abs().max())
            row["replay_vs_eager_bitwise"] = bool(torch.equal(static_out[:real], eager))
            with torch.no_grad():
                row["eager_s"] = _seconds(lambda: forward(ids, positions, params), sync, args.repeats)
                row["eager_padded_s"] = _seconds(lambda: forward(padded_ids, padded_positions, padded_params), sync,
                                                 args.repeats)
            row["replay_s"] = _seconds(replay, sync, args.repeats)
            out["ok"] &= row["replay_vs_eager_max_abs"] <= BF16_TOLERANCE
        tolerance = BF16_TOLERANCE if on_gpu else 1e-5
        out["ok"] &= row["padded_vs_eager_max_abs"] <= tolerance
        out["micro_batches"].append(row)
        print(json.dumps(row), flush=True)

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
    print(f"scoring graph check: {'ok' if out['ok'] else 'FAILED'} ({len(layouts)} micro-batches, bucket {budget})")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
