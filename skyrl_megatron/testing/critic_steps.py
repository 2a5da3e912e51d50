"""Run a few critic-training steps on ranks spawned by `run_on_ranks` (the critic's `policy_steps`).

What the critic worker does per PPO step, without Ray: build the value model from an HF checkpoint
under a layout, score this DP rank's share of a synthetic RL batch, then train mini-batches with
the host's value loss (clipped around perturbed old values) and Megatron's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch


def synthetic_returns(loss_mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Seeded per-row returns on the response tokens (what GAE would hand the critic)."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(loss_mask.shape[0], 1, generator=g) + 0.1 * torch.randn(loss_mask.shape, generator=g)) * loss_mask


def critic_steps(
    rank: int,
    world_size: int,
    hf_dir: str,
    layout: dict[str, Any],
    batching: dict[str, Any],
    *,
    steps: int = 2,
    rows: int = 8,
    prompt_length: int = 6,
    response_length: int = 6,
    lr: float = 1e-3,
    value_clip: float | None = 0.05,
    old_value_noise: float = 0.1,
    seed: int = 5,
    save_dir: str | None = None,
    load_dir: str | None = None,
    export_dir: str | None = None,
    policy_path: str | None = "same",
) -> dict[str, Any]:
    """Per-step metrics (all ranks agree on them), the values scored before and after training (last
    pipeline stage, else None) and this rank's rows. `save_dir` saves a checkpoint after training;
    `load_dir` loads one (model, optimizer, schedule) before scoring; `export_dir` writes the HF
    export after training. `policy_path` decides the head's initialisation as the host's would
    ("same": the critic starts from the policy's checkpoint)."""
    from megatron.core import parallel_state as ps

    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint, save_hf_model
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.compute.losses import ValueObjective
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.hosts import current
    from skyrl_megatron.model.adapters.value_head import ValueHeadInit
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing.rl_batches import make_rl_batch, perturb_logprobs

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, seed=seed)
    ddp = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "average_in_collective": True}
    head = ValueHeadInit.for_checkpoint(hf_dir, policy_path=hf_dir if policy_path == "same" else policy_path, seed=seed)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True, ddp_config=ddp, value_head=head))
    clip = "null" if value_clip is None else value_clip
    host_cfg = compose_config([f"trainer.critic.optimizer_config.lr={lr}", f"trainer.algorithm.value_clip={clip}"])
    cfg = current().our_view(host_cfg)  # what our workers read, on either host
    settings = OptimizerSettings.from_host_config(cfg.trainer.critic.optimizer_config, {}, 100, "fp32")
    optimizer = settings.build_optimizer(built.chunks)
    scheduler = settings.build_scheduler(optimizer)
    if load_dir is not None:
        load_checkpoint(load_dir, built.chunks, optimizer, scheduler)
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_optimizer(optimizer)
    objective = ValueObjective(host_cfg.trainer.algorithm)  # the host's own, as a worker's host_api.algorithm_config
    micro = MicroBatching(**batching)

    full = make_rl_batch(rows, prompt_length, response_length, seed=seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
    batch = {k: v[share] for k, v in full.items()}
    runner.gradients.release()
    initial = runner.response_values(batch["sequences"], batch["attention_mask"], response_length, micro)
    old_full = torch.zeros(rows, response_length)
    if initial is not None:
        old_full[share] = initial
    # the same old values and returns on every layout: drawn for the whole batch, then sliced
    old_full = perturb_logprobs(old_full, full["loss_mask"], old_value_noise, seed=seed)
    response = {
        "loss_mask": batch["loss_mask"],
        "values": old_full[share],
        "returns": synthetic_returns(full["loss_mask"], seed)[share],
    }
    history = []
    for _ in range(steps):
        pending = runner.train_value_mini_batch(
            batch["sequences"], batch["attention_mask"], response, objective, micro, dp_group=ps.get_data_parallel_group(),
            defer_metrics=True,  # read after the step is queued, as the critic worker does
        )
        grad_norm = optimizer_step(optimizer, scheduler).grad_norm
        metrics = {**pending.read(), "grad_norm": grad_norm}
        history.append(metrics)
    final = runner.response_values(batch["sequences"], batch["attention_mask"], response_length, micro)
    if save_dir is not None:
        save_checkpoint(save_dir, built.chunks, optimizer, scheduler, step=steps)
    if export_dir is not None:
        save_hf_model(export_dir, built)
    return {
        "history": history,
        "initial_values": initial,
        "final_values": final,
        "rows": (share.start, share.stop),
    }
