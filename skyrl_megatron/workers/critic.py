"""The critic worker on Megatron-Core: values for GAE, value-loss training, checkpoints, HF export.

The model is the critic checkpoint's GPT trunk with a scalar value head on the last pipeline stage
(`model/adapters/value_head.py`), under the critic's own layout (`trainer.critic.megatron_config`) and its
own optimizer and schedule (`trainer.critic.optimizer_config`). The host's trainer drives it through
its `CriticWorkerBase` contract: `forward` returns values [B, A] for the response tokens; training is
skyrl-train 0.3.1's `ppo_train` (epochs x mini-batches in one call) or skyrl 0.4's `forward_backward`
(one mini-batch) + `optim_step`, both on one mini-batch path with the host's value loss and metric names.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from skyrl_megatron import host_api
from skyrl_megatron.checkpoint import save_hf_model
from skyrl_megatron.compute.losses import ValueObjective
from skyrl_megatron.compute.runner import VALUE_KEYS, mini_batch_rows
from skyrl_megatron.model.adapters.value_head import DEFAULT_VALUE_HEAD_PREFIX, ValueHeadInit
from skyrl_megatron.model.build import ModelSpec
from skyrl_megatron.workers.training import TrainedRoleMixin

logger = logging.getLogger(__name__)

_, _, CriticWorkerBase = host_api.worker_bases()


class MegatronCriticWorker(TrainedRoleMixin, CriticWorkerBase):
    role = "critic"

    def _value_head_prefix(self) -> str:
        return str(self.host_cfg.trainer.algorithm.get("value_head_prefix") or DEFAULT_VALUE_HEAD_PREFIX)

    def _model_spec(self, model_path: str) -> ModelSpec:
        spec = super()._model_spec(model_path)
        spec.value_head = ValueHeadInit.for_checkpoint(
            model_path,
            policy_path=self.host_cfg.trainer.policy.model.get("path"),
            prefix=self._value_head_prefix(),
            seed=int(self.host_cfg.trainer.seed),
        )
        spec.lora = None  # validation refuses LoRA on the Megatron critic
        self._value_head_source = spec.value_head.source
        return spec

    def init_model(self, model_path: str, num_training_steps: int | None = None):
        self._build(model_path)
        self._init_optimizer(self.host_cfg.trainer.critic.optimizer_config, num_training_steps)
        self.objective = ValueObjective(host_api.algorithm_config(self.cfg))
        if torch.distributed.get_rank() == 0:
            logger.info("critic value head: %s", self._value_head_source)

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, data):
        """Values of the states before each response token: {"output": [B, A]} (0 past a response's end)."""
        response_length = int(data.metadata["response_length"])
        self.runner.gradients.release()  # scoring needs no gradients
        with self._watched("scoring"), self._step_guard("scoring"):
            values = self.runner.response_values(
                data["sequences"],
                data["attention_mask"],
                response_length,
                self._batching(self.host_cfg.trainer.micro_forward_batch_size_per_gpu, "scoring"),
            )
        if values is None:  # not the last pipeline stage: the host does not collect from here
            values = torch.zeros(data["sequences"].shape[0], response_length)
        return host_api.scoring_output("values", values.cpu(), dict(data.metadata))

    # -- training: one mini-batch, then one optimizer step ----------------------------------------

    def _train_mini_batch(self, data, start: int = 0, stop: int | None = None, defer_metrics: bool = False):
        """Forward + backward of rows [start, stop) of `data` with the host's value loss; gradients stay
        for `_optimizer_step`. Its metrics, or with `defer_metrics` their `PendingMetrics`."""
        from megatron.core import parallel_state as ps

        missing = [k for k in VALUE_KEYS if k not in data or data[k] is None]
        if missing:
            raise ValueError(f"critic training needs {', '.join(missing)} in the training batch (GAE computes them)")
        batch = mini_batch_rows(data, slice(start, stop), keys=VALUE_KEYS)
        with self._step_guard("training"):
            return self.runner.train_value_mini_batch(
                batch.sequences,
                batch.attention_mask,
                batch.response,
                self.objective,
                self._batching(self.host_cfg.trainer.micro_train_batch_size_per_gpu, "training"),
                dp_group=ps.get_data_parallel_group(),
                defer_metrics=defer_metrics,
            )

    def ppo_train(self, train_data):
        """skyrl-train 0.3.1's contract: epochs x mini-batches of the rank's rows with the host's value
        loss; one optimizer step per mini-batch of `critic_mini_batch_size` prompts' samples."""
        trainer = self.host_cfg.trainer
        rows = train_data["sequences"].shape[0]
        mini = int(trainer.critic_mini_batch_size) * int(self.host_cfg.generator.n_samples_per_prompt) // self.mesh_rank.dp_size
        if mini < 1 or rows % mini:
            raise ValueError(
                f"critic worker got {rows} rows per DP rank, not a multiple of the per-rank mini-batch {mini} "
                "(trainer.critic_mini_batch_size x generator.n_samples_per_prompt / critic DP size); adjust "
                "trainer.train_batch_size or trainer.critic_mini_batch_size"
            )
        history: dict[str, list[float]] = defaultdict(list)
        steps = 0
        with self._watched("training"):
            for _ in range(int(trainer.update_epochs_per_batch)):
                for start in range(0, rows, mini):
                    pending = self._train_mini_batch(train_data, start, start + mini, defer_metrics=True)
                    step = self._optimizer_step()  # queued before the metrics are read: no wait for the backward
                    metrics = {**pending.read(), **step}
                    steps += 1
                    for name, value in metrics.items():
                        history[name].append(value)
        self.runner.gradients.release()
        status = {name: sum(values) / len(values) for name, values in history.items()}
        status["critic_update_steps"] = steps
        status["critic_skipped_steps"] = self.skipped_steps
        return host_api.training_output(metadata={"train_status": status})

    def forward_backward(self, data, **kwargs):
        """skyrl 0.4's contract: one mini-batch (this rank's rows of it), metrics reduced over DP;
        ``optim_step`` follows.

        The loss is the host's: its critic sums per-micro-batch `ppo_critic_loss` and scales the
        gradients by 1 / micro-batches at ``optim_step`` (or weights micro-batches by their rows under a
        token budget), i.e. a mean over the mini-batch's sequences, which is what `ValueObjective`'s
        per-micro-batch shares add up to (over every DP rank's rows).
        """
        if kwargs.get("loss_fn") is not None or kwargs.get("loss_fn_config"):
            raise NotImplementedError(
                "critic forward_backward with a loss_fn/loss_fn_config override is not implemented by "
                "skyrl-megatron; the critic trains with the host's value loss (trainer.algorithm.value_clip)"
            )
        with self._watched("training"):
            metrics = self._train_mini_batch(data)
        metrics["critic_lr"] = self.get_lr()  # the rate the coming optim_step applies
        return host_api.training_status(metrics)

    # -- HF export --------------------------------------------------------------------------------

    def save_hf_model(self, export_dir: str, tokenizer=None):
        """The host's critic layout: the trunk under its HF names and `<value_head_prefix>.weight`
        (no LM head), which a later run's `trainer.critic.model.path` loads the head from. An offloaded
        model (a colocated run's last save) is brought back for the export and parked again."""
        with self._watched("HF export", long_waits=True), self.model_resident():
            save_hf_model(export_dir, self.built, tokenizer, value_head_name=f"{self._value_head_prefix()}.weight")
