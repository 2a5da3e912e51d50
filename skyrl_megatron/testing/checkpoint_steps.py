"""A tiny model's training steps and checkpoints on ranks spawned by `run_on_ranks` (the checkpoint tests).

Every run trains a tiny Qwen3 (fp32, Megatron DDP) on a fixed next-token batch through Megatron's own
loss and pipeline schedule, so what a test compares is the checkpoint, not a training path of ours.
"""

from __future__ import annotations

from pathlib import Path

import torch

SEQ, MICRO_BATCHES = 16, 2
HOST_OPTIMIZER = {
    "lr": 1e-2,
    "adam_betas": [0.8, 0.95],
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "num_warmup_steps": 1,
    "scheduler": "cosine",
}
# Adam divides by sqrt(v): on entries whose gradient is ~0 (lm_head rows of tokens never seen) it
# turns float noise between layouts into lr-sized updates. Measured without any checkpoint, TP=2
# and world-1 weights differ by 8e-5 after one step at eps 1e-8, by 2e-7 at eps 1e-3. The larger
# eps lets the cross-layout comparison measure the checkpoint rather than that noise.
OPTIMIZER_KWARGS = {"adam_eps": 1e-3}
TOTAL_STEPS = 4
WORLD1 = {}
TP2_SP = {"tensor": 2, "sequence_parallel": True}
# The loss here is Megatron's own (labels passed to the model), not one of our code paths. Its fused
# cross-entropy is torch.compile'd: on CPU every fresh rank process then spends ~20 s probing the
# compiler (Inductor builds and loads a test program per vector ISA), several times what the rank's
# training costs. The unfused cross-entropy gives the same properties to check: a real vocab-parallel
# loss whose gradients train the model, identical before and after a resume.
UNFUSED_LOSS = {"cross_entropy_loss_fusion": False}


def micro_batches(data_rank: int, data_size: int):
    """Counting sequences from fixed starts, split over the data-parallel ranks."""
    starts = torch.tensor([3, 40, 101, 200])
    tokens = (starts[:, None] + torch.arange(SEQ + 1)) % 256
    rows = tokens.chunk(data_size)[data_rank]
    return [(mb[:, :-1], mb[:, 1:]) for mb in rows.chunk(MICRO_BATCHES)]


def setup_training(hf_dir: str, layout: dict, distributed_optimizer: bool, *, dtype: str = "fp32",
                   compact_adam: bool = False):
    """A tiny model and its optimizer in `dtype` (bf16: with compact master weights, and `compact_adam` where
    asked), with this rank's micro-batches."""
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    coords = initialize_model_parallel(parallel, seed=0)
    built = build_model(
        ModelSpec(
            hf_dir,
            parallel=parallel,
            dtype=dtype,
            transformer_overrides=UNFUSED_LOSS,
            wrap_with_ddp=True,
            ddp_config={"use_distributed_optimizer": distributed_optimizer, "grad_reduce_in_fp32": True},
        )
    )
    settings = OptimizerSettings.from_host_config(
        HOST_OPTIMIZER, OPTIMIZER_KWARGS, num_training_steps=TOTAL_STEPS, dtype=dtype
    )
    optimizer = settings.build_optimizer(built.chunks, compact_master_weights=dtype == "bf16", compact_adam=compact_adam)
    scheduler = settings.build_scheduler(optimizer)
    return built, optimizer, scheduler, micro_batches(coords.dp, coords.dp_size)


def train_step(chunks, optimizer, scheduler, micro_batches):
    """One optimizer step over the micro-batches through Megatron's pipeline schedule.
    Returns (mean loss on the last pipeline stage or None, StepResult)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from skyrl_megatron.optim import optimizer_step

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    positions = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.clone().detach()}

        return output, loss_func

    data = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    metrics = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=SEQ,
        micro_batch_size=micro_batches[0][0].shape[0],
        forward_only=False,
    )
    finalize_model_grads(list(chunks))
    result = optimizer_step(optimizer, scheduler)
    loss = torch.stack([m["loss"] for m in metrics]).mean().item() if metrics else None
    return loss, result


def local_params(chunks) -> dict[str, torch.Tensor]:
    return {
        f"{index}.{name}": param.detach().clone()
        for index, chunk in enumerate(chunks)
        for name, param in chunk.named_parameters()
    }


def global_tensors(ckpt_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in its global (unsharded) form, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from skyrl_megatron.checkpoint import DIST_SUBDIR

    dcp_to_torch_save(ckpt_dir / DIST_SUBDIR, scratch)
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}
