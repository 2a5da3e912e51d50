"""`make demo`: the biggest real job this release runs end to end on a CPU box.

1. Makes a small Qwen3-shaped Hugging Face checkpoint (random weights, no hub access).
2. Converts it to Megatron-Core through Megatron-Bridge on 2 ranks over gloo with tensor and
   sequence parallelism (TP=2, SP), and checks the logits against the Hugging Face model.
3. Trains a few steps with Megatron DDP and the distributed optimizer on a synthetic next-token task,
   next to a world-1 run from the same checkpoint, printing both losses per step.
4. Exports the trained weights under HF names and checks that the HF model loaded with them gives the
   same logits as the trained Megatron model.
(The GRPO run through the host trainer replaces this once the workers train end to end.)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks

SEQ, BATCH = 32, 4


def _batch(vocab: int):
    """Counting sequences (x, x+1, ...) mod vocab from fixed starts: learnable in a few steps."""
    start = torch.tensor([[3], [40], [101], [200]])[:BATCH] % vocab
    tokens = (start + torch.arange(SEQ + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def _run(rank, world_size, hf_dir: str, tensor: int, steps: int, export_dir: str | None):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(tensor=tensor, sequence_parallel=tensor > 1)
    initialize_model_parallel(parallel, seed=0)
    built = build_model(
        ModelSpec(hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True,
                  ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True})
    )
    (model,) = built.chunks
    vocab = built.provider.vocab_size
    tokens, labels = _batch(vocab)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    with torch.no_grad():
        initial_logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :vocab]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0), [model]
    )
    history = []
    for _ in range(steps):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        # DP grad reduction plus the TP all-reduce of replicated (norm) weights' grads under SP
        finalize_model_grads([model])
        _, grad_norm, _ = optimizer.step()
        history.append((loss.item(), float(grad_norm), time.perf_counter() - start))
    with torch.no_grad():
        final_logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :vocab]
    if export_dir is not None:
        exported = dict(built.bridge.export_hf_weights(built.chunks, cpu=True))
        if rank == 0:
            torch.save(exported, Path(export_dir) / "weights.pt")
    return {"initial_logits": initial_logits, "final_logits": final_logits, "history": history}


def _hf_logits(hf_dir: str, state_dict: dict | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected, unexpected
    tokens, _ = _batch(model.config.vocab_size)
    with torch.no_grad():
        return model(tokens).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        hf_dir = str(make_tiny_hf_model("qwen3", Path(work) / "hf", hidden_size=128, intermediate_size=256))
        print("skyrl-megatron demo: HF Qwen3 -> Megatron-Core (Megatron-Bridge) on CPU over gloo")
        (world1,) = run_on_ranks(_run, 1, hf_dir, 1, args.steps, None, timeout=900)
        tp2 = run_on_ranks(_run, 2, hf_dir, 2, args.steps, work, timeout=900)[0]
        hf_before = _hf_logits(hf_dir)
        hf_after = _hf_logits(hf_dir, torch.load(Path(work) / "weights.pt"))

    def diff(a, b) -> float:
        return (a - b).abs().max().item()

    print(f"logits vs HF before training: world-1 {diff(world1['initial_logits'], hf_before):.1e}, "
          f"TP=2+SP {diff(tp2['initial_logits'], hf_before):.1e}")
    print(f"{'step':>4} {'loss world-1':>13} {'loss TP=2':>11} {'grad norm':>10} {'s/step TP=2':>12}")
    for step, ((l1, _, _), (l2, gn, dt)) in enumerate(zip(world1["history"], tp2["history"])):
        print(f"{step:>4} {l1:>13.6f} {l2:>11.6f} {gn:>10.4f} {dt:>12.3f}")
    loss_gap = max(abs(a[0] - b[0]) for a, b in zip(world1["history"], tp2["history"]))
    export_gap = diff(tp2["final_logits"], hf_after)
    print(f"max |loss world-1 - loss TP=2| = {loss_gap:.1e}")
    print(f"trained weights exported under HF names: HF logits vs Megatron logits {export_gap:.1e}")
    first, last = tp2["history"][0][0], tp2["history"][-1][0]
    print(f"loss {first:.3f} -> {last:.3f}")
    ok = diff(tp2["initial_logits"], hf_before) < 1e-4 and loss_gap < 1e-3 and export_gap < 1e-4 and last < first
    if not ok:
        raise SystemExit("demo: a check failed (see the figures above)")


if __name__ == "__main__":
    main()
