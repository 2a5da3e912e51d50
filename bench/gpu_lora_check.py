"""GPU check of LoRA, one command on one GPU, bf16, Qwen3-1.7B shape (random weights).

1. Memory and speed: one training step of 1 x 4096 tokens, full fine-tune vs LoRA (rank 16, all
   linear layers), each in its own model build: peak memory, tokens/s, trainable parameters.
2. Training: 3 LoRA steps (lr 1e-3, so the adapters move the logprobs measurably); the frozen base is
   bitwise unchanged (SHA-256 of every base parameter before and after).
3. Exports after training: the merged HF export in transformers (bf16, SDPA) and the PEFT adapter
   directory in peft on the HF base, each scored against our Megatron+LoRA logprobs on an RL-shaped
   batch (mean and max |diff| over response tokens; bf16 target: mean < 0.01 as for the base model),
   next to how far training moved them (so the comparison can fail).

Usage (on the GPU machine): python bench/gpu_lora_check.py --out lora.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile

import torch

from gpu_model_checks import _pg_objective, _timed, init_single_gpu, qwen3_config  # same directory

MODEL = "qwen3-1.7b"
TOKENS = 4096
RANK, ALPHA = 16, 32.0
RESPONSE = 256


def _build(hf_dir: str, lora):
    from skyrl_megatron.compute.runner import ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings
    from skyrl_megatron.parallel import ParallelConfig

    parallel = ParallelConfig()
    ddp = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="bf16", wrap_with_ddp=True, ddp_config=ddp, lora=lora))
    settings = OptimizerSettings.from_host_config({"lr": 1e-3, "weight_decay": 0.0, "max_grad_norm": 1.0}, {}, 100, "bf16")
    optimizer = settings.build_optimizer(built.chunks)
    scheduler = settings.build_scheduler(optimizer)
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_optimizer(optimizer)
    return built, optimizer, scheduler, runner


def _step_fn(runner, optimizer, scheduler, vocab: int):
    from skyrl_megatron.compute.runner import MicroBatching
    from skyrl_megatron.optim import optimizer_step

    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, vocab, (1, TOKENS), generator=g)
    mask = torch.ones(1, TOKENS, dtype=torch.long)
    response = {"loss_mask": torch.ones(1, TOKENS // 2), "advantages": torch.ones(1, TOKENS // 2)}

    def step():
        runner.train_mini_batch(sequences, mask, response, _pg_objective, MicroBatching(max_tokens=TOKENS))
        optimizer_step(optimizer, scheduler)

    return step


def _trainable(chunks) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)


def speed_and_memory(hf_dir: str, lora) -> dict:
    gc.collect()  # DDP hooks keep reference cycles: the previous build's memory must really be gone
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    built, optimizer, scheduler, runner = _build(hf_dir, lora)
    seconds = _timed(_step_fn(runner, optimizer, scheduler, built.provider.vocab_size))
    result = {"tokens_per_s": TOKENS / seconds, "peak_gib": (torch.cuda.max_memory_allocated() - resident) / 2**30,
              "resident_before_gib": resident / 2**30, "trainable_params": _trainable(built.chunks)}
    del built, optimizer, scheduler, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _base_digests(chunks) -> dict[str, str]:
    from skyrl_megatron.digests import tensor_sha256

    return {n: tensor_sha256(p) for c in chunks for n, p in c.named_parameters() if not p.requires_grad}


def _hf_logprobs(model, batch) -> torch.Tensor:
    seq, mask = batch["sequences"].cuda(), batch["attention_mask"].cuda()
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(seq, attention_mask=mask, position_ids=position_ids).logits.float()
        return torch.log_softmax(logits[:, -RESPONSE - 1 : -1], -1).gather(-1, seq[:, -RESPONSE:, None]).squeeze(-1).cpu()


def train_and_export(hf_dir: str, lora, work: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.checkpoint import save_hf_model
    from skyrl_megatron.compute.runner import MicroBatching
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    built, optimizer, scheduler, runner = _build(hf_dir, lora)
    batch = make_rl_batch(8, 256, RESPONSE, vocab_size=built.provider.vocab_size, seed=1)
    loss_mask = batch["loss_mask"].bool()

    def ours():
        return runner.response_logprobs(batch["sequences"], batch["attention_mask"], RESPONSE,
                                        MicroBatching(micro_batch_size=4)).cpu()

    before, base_before = ours(), _base_digests(built.chunks)
    step = _step_fn(runner, optimizer, scheduler, built.provider.vocab_size)
    for _ in range(3):
        step()
    after = ours()
    out = {"base_bitwise_unchanged": _base_digests(built.chunks) == base_before,
           "base_params_checked": len(base_before),
           "training_moved_logprobs_mean": (after - before)[loss_mask].abs().mean().item()}
    merged_dir, adapter_dir = os.path.join(work, "merged"), os.path.join(work, "adapter")
    save_hf_model(merged_dir, built)
    save_hf_model(adapter_dir, built, adapters_only=True)
    del built, optimizer, scheduler, runner
    torch.cuda.empty_cache()

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    diff = (_hf_logprobs(base, batch) - before)[loss_mask].abs()
    out["floor_untrained_hf_vs_ours"] = {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}
    del base
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    diff = (_hf_logprobs(merged, batch) - after)[loss_mask].abs()
    out["merged_export_vs_ours"] = {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}
    del merged
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    diff = (_hf_logprobs(adapted, batch) - after)[loss_mask].abs()
    out["peft_adapter_vs_ours"] = {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}
    out["response_tokens"] = int(loss_mask.sum())
    return out


def main() -> None:
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.model.adapters.lora import LoraSpec
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="lora.json")
    args = parser.parse_args()
    init_single_gpu()
    initialize_model_parallel(ParallelConfig(), seed=0)
    work = tempfile.mkdtemp()
    hf_dir = os.path.join(work, MODEL)
    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoModelForCausalLM.from_config(qwen3_config(MODEL), dtype=torch.bfloat16).save_pretrained(hf_dir)
    lora = LoraSpec(rank=RANK, alpha=ALPHA)
    results = {"gpu": torch.cuda.get_device_name(0), "model": MODEL, "lora": {"rank": RANK, "alpha": ALPHA, "targets": "all-linear"}}
    results["lora_step"] = speed_and_memory(hf_dir, lora)
    results["full_finetune_step"] = speed_and_memory(hf_dir, None)
    results["lora_training_and_exports"] = train_and_export(hf_dir, lora, work)
    print(json.dumps(results, indent=2), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
