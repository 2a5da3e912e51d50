"""The critic worker on Megatron-Core: values for GAE, value-loss training, checkpoints, HF export.

The model is the critic checkpoint's GPT trunk with a scalar value head on the last pipeline stage
(`model/value_head.py`), under the critic's own layout (`trainer.critic.megatron_config`) and its
own optimizer and schedule (`trainer.critic.optimizer_config`). The host's trainer drives it through
its `CriticWorkerBase` contract: `forward` returns values [B, A] for the response tokens, `ppo_train`
trains epochs x mini-batches with the host's value loss and reports the host's metric names.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from skyrl_megatron import host_api
from skyrl_megatron.checkpoint import save_hf_model
from skyrl_megatron.compute.losses import ValueObjective
from skyrl_megatron.compute.runner import VALUE_KEYS
from skyrl_megatron.model.build import ModelSpec
from skyrl_megatron.model.value_head import DEFAULT_VALUE_HEAD_PREFIX, ValueHeadInit
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
        self._normalize_mini_batch_size()
        trainer = self.host_cfg.trainer
        self._init_optimizer(trainer.critic.optimizer_config, num_training_steps)
        self.objective = ValueObjective(trainer.algorithm)
        if torch.distributed.get_rank() == 0:
            logger.info("critic value head: %s", self._value_head_source)

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, data):
        """Values of the states before each response token: {"output": [B, A]} (0 past a response's end)."""
        response_length = int(data.metadata["response_length"])
        self.runner.gradients.release()  # scoring needs no gradients
        values = self.runner.response_values(
            data["sequences"],
            data["attention_mask"],
            response_length,
            self._batching(self.host_cfg.trainer.micro_forward_batch_size_per_gpu),
        )
        if values is None:  # not the last pipeline stage: the host does not collect from here
            values = torch.zeros(data["sequences"].shape[0], response_length)
        return host_api.scoring_output("values", values.cpu(), dict(data.metadata))

    # -- training ---------------------------------------------------------------------------------

    def ppo_train(self, train_data):
        """Epochs x mini-batches of the rank's rows with the host's value loss; one optimizer step
        per mini-batch of `critic_mini_batch_size` prompts' samples."""
        from megatron.core import parallel_state as ps

        trainer = self.host_cfg.trainer
        rows = train_data["sequences"].shape[0]
        mini = int(self.critic_mini_batch_size_per_gpu)
        if mini < 1 or rows % mini:
            raise ValueError(
                f"critic worker got {rows} rows per DP rank, not a multiple of the per-rank mini-batch {mini} "
                "(trainer.critic_mini_batch_size x generator.n_samples_per_prompt / critic DP size); adjust "
                "trainer.train_batch_size or trainer.critic_mini_batch_size"
            )
        missing = [k for k in VALUE_KEYS if k not in train_data or train_data[k] is None]
        if missing:
            raise ValueError(f"critic ppo_train needs {', '.join(missing)} in the training batch (GAE computes them)")
        history: dict[str, list[float]] = defaultdict(list)
        steps = 0
        for _ in range(int(trainer.update_epochs_per_batch)):
            for start in range(0, rows, mini):
                rows_slice = slice(start, start + mini)
                response = {k: train_data[k][rows_slice] for k in VALUE_KEYS}
                metrics = self.runner.train_value_mini_batch(
                    train_data["sequences"][rows_slice],
                    train_data["attention_mask"][rows_slice],
                    response,
                    self.objective,
                    self._batching(trainer.micro_train_batch_size_per_gpu),
                    dp_group=ps.get_data_parallel_group(),
                )
                metrics.update(self._optimizer_step())
                steps += 1
                for name, value in metrics.items():
                    history[name].append(value)
        self.runner.gradients.release()
        status = {name: sum(values) / len(values) for name, values in history.items()}
        status["critic_update_steps"] = steps
        status["critic_skipped_steps"] = self.skipped_steps
        return host_api.training_output(metadata={"train_status": status})

    # -- HF export --------------------------------------------------------------------------------

    def save_hf_model(self, export_dir: str, tokenizer=None):
        """The host's critic layout: the trunk under its HF names and `<value_head_prefix>.weight`
        (no LM head), which a later run's `trainer.critic.model.path` loads the head from."""
        save_hf_model(export_dir, self.built, tokenizer, value_head_name=f"{self._value_head_prefix()}.weight")
