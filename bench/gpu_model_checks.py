"""GPU checks of the model path, one command on one GPU:

1. bf16 logprob parity: a Qwen3 model of the 0.6B shape (random weights, saved as an HF checkpoint)
   scored by our Megatron path (bridge conversion, our core attention, chunked vocab-parallel
   logprobs) vs Hugging Face with SDPA attention; mean and max |logprob diff| over response tokens.
2. varlen attention: our packed (THD) kernel path (`varlen_attn`) vs per-sequence SDPA, and the
   context-parallel segment layout (bottom-right causal) vs its masked-SDPA reference, in bf16
   (flash-attn-4, `attention_kernel=flash4`, against varlen_attn and fp32: bench/gpu_fa4_check.py).
3. one training step (forward + backward + Adam) of 1 x 4096 tokens for Qwen3-1.7B and -4B shapes:
   our Megatron path vs Hugging Face (SDPA) + FSDP2, tokens/s, MFU and peak memory.

Usage (on the GPU machine): python bench/gpu_model_checks.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

SHAPES = {
    # Qwen3 published architectures (hidden, layers, heads, kv heads, intermediate); vocab 151936
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, intermediate_size=9728, tie_word_embeddings=True),
}
PEAK_BF16_TFLOPS = {"H200": 790.0, "H100": 790.0}  # measured dense bf16 peak on the lent machines (FACTS §5)


def qwen3_config(name: str):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, **SHAPES[name])
    config.architectures = ["Qwen3ForCausalLM"]  # the bridge picks its converter by architecture
    return config


def free_port() -> int:
    """A TCP port nobody listens on now, for a process group's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_single_gpu() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)


def train_flops_per_token(config, seq: int) -> float:
    """6 x matmul params + causal attention (fwd 2 x 2 x seq/2 x d per layer per token, x3 with bwd)."""
    h, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    matmul = layers * per_layer + config.vocab_size * h
    attention = layers * 2 * 2 * (seq / 2) * q
    return 6 * matmul + 3 * attention


# ----------------------------------------------------------------------------------------------
# 1. logprob parity
# ----------------------------------------------------------------------------------------------


def logprob_parity(workdir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.layers.fusions import FUSED_KERNELS
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    torch.manual_seed(0)
    hf_dir = os.path.join(workdir, "qwen3-0.6b")
    model = AutoModelForCausalLM.from_config(qwen3_config("qwen3-0.6b"), dtype=torch.bfloat16)
    model.save_pretrained(hf_dir)
    model = model.cuda().eval()
    model.config._attn_implementation = "sdpa"
    batch = make_rl_batch(8, 256, 512, vocab_size=151936, seed=1)
    seq, mask = batch["sequences"].cuda(), batch["attention_mask"].cuda()
    response = 512
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(seq, attention_mask=mask, position_ids=position_ids).logits.float()
        hf = torch.log_softmax(logits[:, -response - 1 : -1], -1).gather(-1, seq[:, -response:, None]).squeeze(-1)
    del model, logits
    torch.cuda.empty_cache()

    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    loss_mask = batch["loss_mask"].bool()
    out = {}
    # every generated kernel of megatron_config.fused_kernels, and PyTorch's eager ones
    for kernels_name, kernels in (("fused", FUSED_KERNELS), ("eager", ())):
        built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="bf16", fused_kernels=kernels))
        runner = ModelRunner(built.chunks, parallel, fused_logprobs=built.fused_logprobs)
        batchings = (("padded", MicroBatching(micro_batch_size=4)), ("packed", MicroBatching(max_tokens=4096)))
        for name, batching in batchings:
            ours = runner.response_logprobs(batch["sequences"], batch["attention_mask"], response, batching).cpu()
            diff = (ours - hf.cpu())[loss_mask].abs()
            out[f"{name} ({kernels_name}: {', '.join(built.fused_kernels) or 'none'})"] = {
                "mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(), "tokens": int(loss_mask.sum())
            }
        del built, runner
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# 2. varlen attention vs SDPA
# ----------------------------------------------------------------------------------------------


def varlen_vs_sdpa() -> dict:
    import torch.nn.functional as F

    from skyrl_megatron.attention_kernels import SegmentKernel
    from skyrl_megatron.model.layers.attention import CausalSegments, attend_segments, context_parallel_segments

    torch.manual_seed(0)
    lengths = [17, 300, 1024, 64, 2000]
    heads, groups, dim = 16, 8, 128
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, groups, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    segments = CausalSegments(cu, cu, max(lengths), max(lengths))
    scale = dim**-0.5
    ours = attend_segments(q, k, v, segments, scale, SegmentKernel.VARLEN)
    reference = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True,
        )
        reference.append(ref.transpose(0, 1))
    reference = torch.cat(reference)
    packed = (ours.float() - reference.float()).abs()

    # the CP layout: rank 1 of CP 2, keys all-gathered rank-major (bottom-right causal segments)
    cp_lengths = (256, 1024)
    cp_total = sum(cp_lengths)
    segs = context_parallel_segments(cp_lengths, 1, 2, torch.device("cuda"))
    q_local = torch.randn(cp_total // 2, heads, dim, device="cuda", dtype=torch.bfloat16)
    k_all = torch.randn(cp_total, groups, dim, device="cuda", dtype=torch.bfloat16)
    v_all = torch.randn(cp_total, groups, dim, device="cuda", dtype=torch.bfloat16)
    flash = attend_segments(q_local, k_all, v_all, segs, scale, SegmentKernel.VARLEN)
    masked = attend_segments(q_local.float(), k_all.float(), v_all.float(), segs, scale, SegmentKernel.MASKED_SDPA)
    cp = (flash.float() - masked).abs()
    return {
        "packed_vs_per_sequence_sdpa": {"max_abs": packed.max().item(), "mean_abs": packed.mean().item()},
        "cp_segments_flash_vs_masked_fp32": {"max_abs": cp.max().item(), "mean_abs": cp.mean().item()},
    }


# ----------------------------------------------------------------------------------------------
# 3. one-step throughput
# ----------------------------------------------------------------------------------------------


def _timed(step, warmup: int = 1, repeats: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pg_objective(log_probs, entropy, batch, totals):
    mask = batch["loss_mask"]
    loss = -(log_probs * batch["advantages"] * mask).sum() / totals.tokens
    return loss, {"loss": loss.detach().double()}


def megatron_step(name: str, tokens: int) -> dict:
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, make_provider
    from skyrl_megatron.model.conversion.bridge_import import import_bridge
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    torch.cuda.reset_peak_memory_stats()
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    config = qwen3_config(name)
    spec = ModelSpec("<config only>", parallel=parallel, dtype="bf16", wrap_with_ddp=True, load_weights=False,
                     ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True})
    provider = make_provider(spec, import_bridge().AutoBridge.from_hf_config(config))
    from megatron.core.distributed import DistributedDataParallelConfig

    chunks = provider.provide_distributed_model(ddp_config=DistributedDataParallelConfig(**spec.ddp_config), wrap_with_ddp=True, bf16=True)
    settings = OptimizerSettings.from_host_config({"lr": 1e-6, "weight_decay": 0.01, "max_grad_norm": 1.0}, {}, 100, "bf16")
    optimizer = settings.build_optimizer(chunks)
    scheduler = settings.build_scheduler(optimizer)
    runner = ModelRunner(chunks, parallel)
    runner.attach_optimizer(optimizer)
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, config.vocab_size, (1, tokens), generator=g)
    attention_mask = torch.ones(1, tokens, dtype=torch.long)
    response = {"loss_mask": torch.ones(1, tokens // 2), "advantages": torch.ones(1, tokens // 2)}

    def step():
        runner.train_mini_batch(sequences, attention_mask, response, _pg_objective, MicroBatching(max_tokens=tokens))
        optimizer_step(optimizer, scheduler)

    seconds = _timed(step)
    result = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del chunks, optimizer, runner
    torch.cuda.empty_cache()
    return result


def fsdp2_step(name: str, tokens: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    torch.cuda.reset_peak_memory_stats()
    config = qwen3_config(name)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_disable()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, config.vocab_size, (1, tokens), generator=g).cuda()

    def step():
        logits = model(sequences).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        loss = -logprobs[:, -tokens // 2 :].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = _timed(step)
    result = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_model_checks.json")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--only", default="parity,varlen,throughput")
    # one process per (model, path) gives clean peak-memory figures
    parser.add_argument("--models", default="qwen3-1.7b,qwen3-4b")
    parser.add_argument("--paths", default="megatron,hf_fsdp2")
    args = parser.parse_args()
    init_single_gpu()
    from skyrl_megatron.runtime import activate_runtime

    activate_runtime("cuda")
    gpu = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), 790.0)
    results: dict = {"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    only = set(args.only.split(","))

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(json.dumps(results, indent=2), flush=True)

    if "varlen" in only:
        results["varlen"] = varlen_vs_sdpa()
        save()
    if "parity" in only:
        with tempfile.TemporaryDirectory() as workdir:
            results["logprob_parity_qwen3_0.6b_bf16"] = logprob_parity(workdir)
        save()
    if "throughput" in only:
        steps = {"megatron": megatron_step, "hf_fsdp2": fsdp2_step}
        for name in args.models.split(","):
            flops = train_flops_per_token(qwen3_config(name), args.tokens)
            row = {}
            for path in args.paths.split(","):
                fn = steps[path]
                try:
                    row[path] = fn(name, args.tokens)
                    row[path]["mfu"] = row[path]["tokens_per_s"] * flops / (peak * 1e12)
                except Exception as exc:  # record and go on: one failure must not cost the other figures
                    import traceback

                    traceback.print_exc()
                    row[path] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            results[f"train_step_{name}_{args.tokens}"] = row
            save()


if __name__ == "__main__":
    main()
