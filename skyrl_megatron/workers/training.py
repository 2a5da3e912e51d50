"""What the roles that train (policy, critic) share: their optimizer and schedule, one optimizer step
with its metrics (and skyrl 0.4's ``optim_step`` / ``get_lr`` on it), and distributed checkpoints of
weights, optimizer, schedule and skipped steps."""

from __future__ import annotations

from typing import Any

import torch

from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint
from skyrl_megatron.master_weights import masters_materialised
from skyrl_megatron.optim import OptimizerSettings, current_lr, optimizer_step
from skyrl_megatron.workers.base import MegatronWorkerMixin


class TrainedRoleMixin(MegatronWorkerMixin):
    trains = True

    def _init_optimizer(self, optimizer_config: Any, num_training_steps: int | None) -> None:
        """Megatron's optimizer and schedule from the role's host `optimizer_config` (our kwargs win)."""
        settings = OptimizerSettings.from_host_config(
            optimizer_config,
            self.megatron_cfg.optimizer_config_kwargs,
            int(num_training_steps or 1_000_000_000),
            "bf16" if self.host_cfg.trainer.bf16 else "fp32",
        )
        self.optimizer = settings.build_optimizer(
            self.built.chunks, compact_master_weights=self.megatron_cfg.compact_master_weights
        )
        self.scheduler = settings.build_scheduler(self.optimizer)
        self.runner.attach_optimizer(self.optimizer)
        self.skipped_steps = 0

    def _optimizer_step(self) -> dict[str, float]:
        """Apply the accumulated gradients: the host's grad-norm metric and ``<role>_lr``."""
        # Adam's moments are created at the first step: the step's own memory peak
        with torch.profiler.record_function("skyrl_megatron.optimizer_step"), self.phase_peaks.measure("optimizer_step"):
            step = optimizer_step(self.optimizer, self.scheduler)
        self.skipped_steps += int(step.skipped)
        return {
            "raw_grad_norm": step.grad_norm if step.grad_norm is not None else float("nan"),
            f"{self.role}_lr": step.lr if step.lr is not None else 0.0,
        }

    def optim_step(self) -> float | None:
        """skyrl 0.4's contract: apply the gradients of the last ``forward_backward``; the grad norm
        (None for a skipped step)."""
        metrics = self._optimizer_step()  # gradients stay allocated for the next mini-batch; scoring frees them
        grad_norm = metrics["raw_grad_norm"]
        return None if grad_norm != grad_norm else float(grad_norm)

    def get_lr(self) -> float:
        return current_lr(self.optimizer) or 0.0

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir, tokenizer=None):
        save_checkpoint(
            ckpt_dir,
            self.built.chunks,
            self.optimizer,
            self.scheduler,
            step=int(self.scheduler.num_steps),
            extra={"skipped_steps": self.skipped_steps},
            tokenizer=tokenizer,  # inside the atomic save
        )

    def load_checkpoint(self, ckpt_dir, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True):
        # compact master weights: present while the model weights they are relative to change
        with masters_materialised(self.optimizer):
            state = load_checkpoint(
                ckpt_dir,
                self.built.chunks,
                self.optimizer if load_optimizer_states else None,
                self.scheduler if load_lr_scheduler_states else None,
            )
            if not load_optimizer_states:
                # bf16: the optimizer's fp32 main params would overwrite the loaded weights at the next step
                self.optimizer.reload_model_params()
        self.skipped_steps = int(state.extra.get("skipped_steps", 0))
        if self.manual_gc is not None:
            self.manual_gc.freeze_again()  # the loaded state lives on
        return {"step": state.step, **state.extra}
