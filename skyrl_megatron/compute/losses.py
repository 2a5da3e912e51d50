"""The policy objective and the critic's value loss: the host's loss functions, normalised over the whole mini-batch.

The host's loss functions (policy-loss registry, KL estimator, masked means) reduce over the tensors
they are given. Called on one micro-batch, a `token_mean` loss is the mean over that micro-batch's
tokens, so the mini-batch loss would depend on how rows were split into micro-batches and DP ranks
(token-budget micro-batches make that split data dependent). We call the host's functions per
micro-batch and weight each result by its share of the mini-batch (tokens for token means,
sequences for sequence means), with the totals summed over DP ranks. The sum over micro-batches and
ranks is then exactly the host's formula applied to the whole mini-batch, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from skyrl_megatron import host_api
from skyrl_megatron.compute.pending_metrics import PendingMetrics

# host `loss_reduction` -> which count a micro-batch result is weighted by
_REDUCTION_UNIT = {"token_mean": "tokens", "sequence_mean": "sequences", "seq_mean_token_sum_norm": "sequences"}


@dataclass(frozen=True)
class ObjectiveSettings:
    """The loss-related keys of the host's `trainer.algorithm` section."""

    policy_loss_type: str = "regular"
    loss_reduction: str = "token_mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator_type: str = "k3"
    use_entropy_loss: bool = False
    entropy_loss_coef: float = 0.0
    algorithm: Any = None  # the host's DictConfig, passed through to its loss functions

    @classmethod
    def from_algorithm_config(cls, algorithm: Any) -> "ObjectiveSettings":
        if algorithm.loss_reduction not in _REDUCTION_UNIT:
            raise ValueError(
                f"trainer.algorithm.loss_reduction={algorithm.loss_reduction!r} is not supported; "
                f"use one of {sorted(_REDUCTION_UNIT)}"
            )
        return cls(
            policy_loss_type=str(algorithm.policy_loss_type),
            loss_reduction=str(algorithm.loss_reduction),
            use_kl_loss=bool(algorithm.use_kl_loss),
            kl_loss_coef=float(algorithm.kl_loss_coef),
            kl_estimator_type=str(algorithm.kl_estimator_type),
            use_entropy_loss=bool(algorithm.use_entropy_loss),
            entropy_loss_coef=float(algorithm.entropy_loss_coef),
            algorithm=algorithm,
        )


@dataclass(frozen=True)
class MiniBatchTotals:
    """Token and sequence counts of a whole mini-batch (summed over DP ranks)."""

    tokens: float
    sequences: float

    @classmethod
    def of(cls, loss_mask: torch.Tensor, dp_group=None, device=None) -> "MiniBatchTotals":
        import torch.distributed as dist

        # on the collective's device (NCCL reduces only CUDA tensors)
        counts = torch.tensor([float(loss_mask.sum()), float(loss_mask.shape[0])], dtype=torch.float64, device=device)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(counts, group=dp_group)
        return cls(tokens=max(counts[0].item(), 1.0), sequences=max(counts[1].item(), 1.0))

    def share(self, loss_mask: torch.Tensor, unit: str) -> torch.Tensor | float:
        if unit == "tokens":
            # stays on the device: a float() here would make every micro-batch wait for the GPU
            return loss_mask.sum(dtype=torch.float32) / self.tokens
        return loss_mask.shape[0] / self.sequences


class PolicyObjective:
    """Loss of one micro-batch, as its share of the mini-batch objective, plus metrics."""

    def __init__(self, settings: ObjectiveSettings):
        self.settings = settings
        self.policy_loss_fn = host_api.policy_loss_function(settings.policy_loss_type)

    def __call__(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        batch: Mapping[str, torch.Tensor],
        totals: MiniBatchTotals,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        loss_mask = batch["loss_mask"]
        token_share = totals.share(loss_mask, "tokens")
        sequence_share = totals.share(loss_mask, "sequences")
        if host_api.policy_losses_are_presummed:
            # the host scaled the advantages so that summing every token's loss over the mini-batch
            # gives its reduction: a micro-batch's sum already is its share
            policy_share = 1.0
        else:
            policy_share = token_share if _REDUCTION_UNIT[s.loss_reduction] == "tokens" else sequence_share

        policy_loss, loss_metrics = self.policy_loss_fn(
            log_probs,
            batch["action_log_probs"],
            batch["advantages"],
            config=s.algorithm,
            loss_mask=loss_mask,
            rollout_logprobs=batch.get("rollout_logprobs"),
        )
        # 0.3.1's losses return the clip ratio, 0.4's a dict of metrics holding it
        clip_ratio = loss_metrics.get("clip_ratio", 0.0) if isinstance(loss_metrics, Mapping) else loss_metrics
        loss = policy_loss * policy_share
        with torch.no_grad():
            # the first mini-batch of a step must see log_probs == old log_probs: ratio 1, ppo_kl 0
            ppo_kl = host_api.masked_mean(batch["action_log_probs"] - log_probs, loss_mask) * token_share
        metrics = {
            "policy_loss": (policy_loss * policy_share).detach(),
            "ppo_kl": ppo_kl,
            # the host's clip ratio is a token mean over the micro-batch
            "ppo_clip_ratio": torch.as_tensor(clip_ratio, dtype=torch.float64, device=loss_mask.device) * token_share,
        }
        if entropy is not None:
            entropy_mean = host_api.masked_mean(entropy, loss_mask) * token_share
            metrics["policy_entropy"] = entropy_mean.detach()
            if s.use_entropy_loss:
                loss = loss - s.entropy_loss_coef * entropy_mean
        if s.use_kl_loss:
            kl = host_api.approx_kl(log_probs, batch["base_action_log_probs"], loss_mask, s.kl_estimator_type)
            # the host's form: per-sequence token mean, then the batch mean
            kl_mean = host_api.masked_mean(kl, loss_mask, dim=-1).sum() / totals.sequences
            loss = loss + s.kl_loss_coef * kl_mean
            metrics["policy_kl"] = kl_mean.detach()
        metrics["final_loss"] = loss.detach()
        return loss, {k: v.to(torch.float64).reshape(()) for k, v in metrics.items()}


class ValueObjective:
    """The critic's loss of one micro-batch, as its share of the mini-batch's, plus metrics.

    The host's value loss (`ppo_critic_loss`: squared error to the returns, clipped around the old
    values by `trainer.algorithm.value_clip`, halved) is a per-sequence token mean, then a mean over
    sequences, whatever `loss_reduction` says; each micro-batch's result is weighted by its share of
    the mini-batch's sequences, so the sum is the host's loss over the whole mini-batch. The
    metrics (`critic_loss`, `values_mean`, `values_clipfrac`) are those the host reports; the loss
    is the mini-batch's (the host logs each micro-batch's divided by the accumulation steps).
    """

    def __init__(self, algorithm: Any):
        self.algorithm = algorithm  # the host's `trainer.algorithm` (value_clip)
        self.loss_fn = host_api.critic_loss_function()

    def __call__(
        self, values: torch.Tensor, batch: Mapping[str, torch.Tensor], totals: MiniBatchTotals
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss_mask = batch["loss_mask"]
        token_share = totals.share(loss_mask, "tokens")
        sequence_share = totals.share(loss_mask, "sequences")
        loss, clipfrac = self.loss_fn(values, batch["values"], batch["returns"], config=self.algorithm, loss_mask=loss_mask)
        loss = loss * sequence_share
        metrics = {
            "critic_loss": loss.detach(),
            "values_mean": (host_api.masked_mean(values.detach(), loss_mask) * token_share),
        }
        if clipfrac is not None:  # value_clip: null turns clipping off
            metrics["values_clipfrac"] = torch.as_tensor(clipfrac, dtype=torch.float64, device=loss_mask.device) * token_share
        return loss, {k: v.to(torch.float64).reshape(()) for k, v in metrics.items()}


def mini_batch_metrics(per_micro_batch: list[dict], dp_group, device) -> PendingMetrics:
    """A mini-batch's metrics: its micro-batches' (each already their share of the mini-batch) summed, then
    over DP ranks; broadcast from the last pipeline stage, where the loss ran, so every rank reads them. The sums and
    collectives are queued here; the values reach the host when read."""
    from megatron.core import parallel_state as ps

    names = sorted({k for m in per_micro_batch for k in m})
    # every rank must agree on the metric names for the collectives below: take them from the
    # last stage, where the loss function ran
    names_list = [names]
    last = ps.get_pipeline_model_parallel_last_rank()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(names_list, src=last, group=ps.get_pipeline_model_parallel_group())
    names = names_list[0]
    totals = torch.zeros(len(names), dtype=torch.float64, device=device)
    for m in per_micro_batch:
        for i, name in enumerate(names):
            if name in m:
                totals[i] += m[name].to(torch.float64)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=last, group=ps.get_pipeline_model_parallel_group())
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    return PendingMetrics(lambda: dict(zip(names, totals.tolist())))
