"""`make demo`: the biggest real job this release runs end to end on a CPU box.

Two ranks over gloo train a small Megatron-Core GPT with tensor parallelism (TP=2) and the
distributed optimizer on a synthetic next-token task, next to a world-1 run from the same weights;
it prints per-step loss for both and the largest difference. (The GRPO run through the host trainer
replaces this once the workers train end to end.)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from skyrl_megatron.testing import run_on_ranks

VOCAB, SEQ, BATCH = 256, 32, 4


def _model(runtime, tp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=384,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        **runtime.transformer_config_overrides(),
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def _batch():
    """Counting sequences (x, x+1, x+2, ...) mod VOCAB from fixed starts: learnable in a few steps."""
    start = torch.tensor([[3], [40], [101], [200]])[:BATCH]
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _train(rank, world_size, tp: int, steps: int, ckpt_dir: str, save: bool):
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(tensor=tp), seed=0)
    model = _model(runtime, tp)
    if save:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    history = []
    for step in range(steps):
        tokens, labels = _batch()
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        _, grad_norm, _ = optimizer.step()
        history.append((loss.item(), float(grad_norm), time.perf_counter() - start))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as ckpt:
        print("skyrl-megatron demo: Megatron-Core GPT on CPU (gloo), world-1 vs TP=2 from the same weights")
        (reference,) = run_on_ranks(_train, 1, 1, args.steps, ckpt, True, timeout=600)
        tp2 = run_on_ranks(_train, 2, 2, args.steps, ckpt, False, timeout=600)[0]
    print(f"{'step':>4} {'loss world-1':>13} {'loss TP=2':>11} {'grad norm':>10} {'s/step TP=2':>12}")
    for step, ((l1, _, _), (l2, gn, dt)) in enumerate(zip(reference, tp2)):
        print(f"{step:>4} {l1:>13.6f} {l2:>11.6f} {gn:>10.4f} {dt:>12.3f}")
    max_diff = max(abs(a[0] - b[0]) for a, b in zip(reference, tp2))
    print(f"max |loss world-1 - loss TP=2| = {max_diff:.2e}; loss {tp2[0][0]:.3f} -> {tp2[-1][0]:.3f}")
    # TP changes the order of floating-point reductions, so the runs drift apart slowly
    if max_diff > 1e-3 or not tp2[-1][0] < 0.5 * tp2[0][0]:
        raise SystemExit("demo: TP=2 diverged from world-1 or did not learn")


if __name__ == "__main__":
    main()
