"""Run a few policy-training steps on ranks spawned by `run_on_ranks` (shared by tests and bench smoke).

Everything a worker does per step, without Ray: build the model from an HF checkpoint under a
layout, take this DP rank's share of a synthetic RL batch, score old logprobs, then train
mini-batches with the host's objective and Megatron's optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch



def max_seq_len_override(tokens: int) -> str:
    """`trainer.algorithm.max_seq_len`, which the host derives in its validation (seq_mean_token_sum_norm
    needs it): skyrl 0.4's typed config has the field and refuses "+"; skyrl-train 0.3.1's Hydra config
    has no such key, so it is added ("++")."""
    from skyrl_megatron.hosts import current
    from skyrl_megatron.hosts.skyrl_train_0_3 import SkyRLTrain03

    prefix = "++" if isinstance(current(), SkyRLTrain03) else ""
    return f"{prefix}trainer.algorithm.max_seq_len={tokens}"

def policy_steps(
    rank: int,
    world_size: int,
    hf_dir: str,
    layout: dict[str, Any],
    batching: dict[str, Any],
    *,
    host_overrides: list[str] = (),
    steps: int = 3,
    rows: int = 8,
    prompt_length: int = 6,
    response_length: int = 6,
    lr: float = 1e-3,
    distributed_optimizer: bool = True,
    seed: int = 5,
    old_logprob_noise: float = 0.0,
    spec_overrides: dict[str, Any] | None = None,
    router_metrics: bool = False,
    inspect: Callable[[list], Any] | None = None,
    routing_replay: bool = False,
    score_batching: dict[str, Any] | None = None,
    prepare: Callable[[list], Any] | None = None,
    ratio_check: bool = False,
    batch: dict[str, torch.Tensor] | None = None,
    engine_routes: list | None = None,
    dtype: str = "fp32",
    compact_master_weights: bool = False,
) -> dict[str, Any]:
    """Returns per-step metrics (all ranks agree on them), the logprobs scored before training (on
    the last pipeline stage, else None) and which rows of the batch this rank's DP group had.

    `spec_overrides` replaces ModelSpec fields (e.g. `moe`, `transformer_overrides`);
    `router_metrics` adds the MoE router metrics of each step's mini-batch to its metrics;
    `inspect(chunks)` runs before and after training, its results under "inspected";
    `routing_replay` records MoE routes while scoring and replays them in training (R2), and scores
    once more replaying them (their routes under "replayed_routes", the recorded ones under
    "recorded_routes", [rows, S, L, k] of this rank's DP share and route layers);
    `score_batching` scores in another micro-batch plan than training's; `prepare(chunks)` runs once
    the runner is set up; `ratio_check` adds the metric "abs_log_ratio_sum": sum over response
    tokens of |log-prob - old log-prob| (0 exactly when every importance ratio is exactly 1);
    `batch` replaces the synthetic one (`sequences`, `attention_mask`, `loss_mask`, `advantages`);
    `engine_routes` (R3, with `routing_replay`): an inference engine's routes per row of the batch,
    replayed in scoring, whose routes training then replays. `dtype` is the model's (bf16: fp32 master weights in
    the optimizer, kept compact between steps with `compact_master_weights`).
    """
    from megatron.core import parallel_state as ps

    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.compute.losses import ObjectiveSettings, PolicyObjective
    from skyrl_megatron.compute.router_metrics import RouterMetrics
    from skyrl_megatron.hosts import current
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing.rl_batches import make_rl_batch, perturb_logprobs
    from skyrl_megatron.compute.route_replay import RouteReplay, RouteStore, host_columns, rollout_routes
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, seed=seed)
    ddp = {"use_distributed_optimizer": distributed_optimizer, "grad_reduce_in_fp32": True, "average_in_collective": True}
    spec = ModelSpec(hf_dir, parallel=parallel, dtype=dtype, wrap_with_ddp=True, ddp_config=ddp)
    built = build_model(dataclasses.replace(spec, **(spec_overrides or {})))
    inspected = [inspect(built.chunks)] if inspect is not None else []
    max_seq_len = max_seq_len_override(prompt_length + response_length)
    host_cfg = compose_config([f"trainer.policy.optimizer_config.lr={lr}", max_seq_len, *host_overrides])
    cfg = current().our_view(host_cfg)  # what our workers read, on either host
    settings = OptimizerSettings.from_host_config(cfg.trainer.policy.optimizer_config, {}, 100, dtype)
    optimizer = settings.build_optimizer(built.chunks, compact_master_weights=compact_master_weights)
    scheduler = settings.build_scheduler(optimizer)
    runner = ModelRunner(built.chunks, parallel)
    runner.attach_optimizer(optimizer)
    collector = RouterMetrics.attach(built.chunks) if router_metrics else None
    if collector is not None:
        runner.attach_router_metrics(collector)
    # the host's own algorithm config, as its loss functions take it (a worker: host_api.algorithm_config)
    objective = PolicyObjective(ObjectiveSettings.from_algorithm_config(host_cfg.trainer.algorithm))
    if ratio_check:
        objective = _with_ratio_check(objective)
    micro = MicroBatching(**batching)
    score_micro = MicroBatching(**score_batching) if score_batching is not None else micro
    store = RouteStore() if routing_replay else None
    replay = RouteReplay(built.chunks) if routing_replay else None
    if replay is not None:
        runner.attach_route_replay(replay)
    if prepare is not None:
        prepare(built.chunks)

    full = batch if batch is not None else make_rl_batch(rows, prompt_length, response_length, seed=seed)
    rows, response_length = full["sequences"].shape[0], full["loss_mask"].shape[1]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
    batch = {k: v[share] for k, v in full.items()}
    runner.gradients.release()  # as the worker scores: without gradient storage
    from_engine = None
    if engine_routes is not None:
        from_engine = host_columns(
            rollout_routes(engine_routes[share], batch["attention_mask"], replay), batch["attention_mask"]
        )
    old = runner.response_logprobs(
        batch["sequences"], batch["attention_mask"], response_length, score_micro, routes=from_engine,
        record_routes=store,
    )
    routes = None
    replay_check = {}
    if store is not None:
        routes = host_columns(store.lookup(batch["sequences"], batch["attention_mask"]), batch["attention_mask"])
        again = RouteStore()
        runner.response_logprobs(
            batch["sequences"], batch["attention_mask"], response_length, micro, routes=routes, record_routes=again
        )
        replayed = host_columns(again.lookup(batch["sequences"], batch["attention_mask"]), batch["attention_mask"])
        replay_check = {"recorded_routes": routes, "replayed_routes": replayed, "engine_routes": from_engine}
    old_full = torch.zeros(rows, response_length)
    if old is not None:
        old_full[share] = old
    # the same noise on every layout: drawn for the whole batch, then sliced
    old_full = perturb_logprobs(old_full, full["loss_mask"], old_logprob_noise, seed=seed)
    batch["action_log_probs"] = old_full[share]
    batch["base_action_log_probs"] = batch["action_log_probs"] - 0.1 * batch["loss_mask"]

    history = []
    response = {k: v for k, v in batch.items() if k not in ("sequences", "attention_mask")}
    for _ in range(steps):
        pending = runner.train_mini_batch(
            batch["sequences"],
            batch["attention_mask"],
            response,
            objective,
            micro,
            dp_group=ps.get_data_parallel_group(),
            routes=routes,
            defer_metrics=True,  # read after the step is queued, as the policy worker does
        )
        result = optimizer_step(optimizer, scheduler)
        metrics = pending.read()
        metrics["grad_norm"] = result.grad_norm
        history.append(metrics)
    if inspect is not None:
        inspected.append(inspect(built.chunks))
    return {
        "history": history, "initial_logprobs": old, "rows": (share.start, share.stop), "inspected": inspected,
        **replay_check,
    }


def policy_gradient_objective(log_probs, entropy, batch, totals):
    """The plainest policy objective: -(logprob x advantage) over the mini-batch's response tokens."""
    loss = -(log_probs * batch["advantages"] * batch["loss_mask"]).sum() / totals.tokens
    return loss, {"loss": loss.detach().double()}


def train_one_mini_batch(
    hf_dir: str,
    batch: dict[str, torch.Tensor],
    *,
    transformer_overrides: dict[str, Any],
    ddp_config: dict[str, Any],
    micro_batch_size: int = 2,
) -> tuple[Any, dict[str, float]]:
    """Build the model at world 1 (fp32, Megatron DDP) and run one mini-batch of `batch` forward and
    backward with `policy_gradient_objective`, gradients finalised into DDP's `main_grad`.
    Returns the built model and the step's metrics. Call on a rank with the CPU runtime started."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    spec = ModelSpec(
        hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True,
        transformer_overrides=transformer_overrides, ddp_config=ddp_config,
    )
    built = build_model(spec)
    get_model_config(built.chunks[0]).finalize_model_grads_func = finalize_model_grads
    metrics = ModelRunner(built.chunks, parallel).train_mini_batch(
        batch["sequences"],
        batch["attention_mask"],
        {"loss_mask": batch["loss_mask"], "advantages": batch["advantages"]},
        policy_gradient_objective,
        MicroBatching(micro_batch_size=micro_batch_size),
    )
    return built, metrics


def _with_ratio_check(objective):
    def checked(log_probs, entropy, batch, totals):
        loss, metrics = objective(log_probs, entropy, batch, totals)
        gap = ((log_probs.detach() - batch["action_log_probs"]).abs() * batch["loss_mask"]).sum()
        return loss, {**metrics, "abs_log_ratio_sum": gap.double()}

    return checked
