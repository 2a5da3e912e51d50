"""What the roles that train (policy, critic) share: their optimizer and schedule, one optimizer step
with its metrics (and skyrl 0.4's ``optim_step`` / ``get_lr`` on it), and distributed checkpoints of
weights, optimizer, schedule and skipped steps, written in the background with ``megatron_config.async_save``
(published by ``finalize_pending_saves``: the next save, the end of training, the trainer's step end)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from skyrl_megatron.checkpoint import AsyncCheckpointSaver, SaveTimings, load_checkpoint, save_checkpoint
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
            self.built.chunks, compact_master_weights=self.megatron_cfg.compact_master_weights,
            compact_adam=self.megatron_cfg.compact_adam,
        )
        self.scheduler = settings.build_scheduler(self.optimizer)
        self.runner.attach_optimizer(self.optimizer)
        self.skipped_steps = 0
        self.background_saves = AsyncCheckpointSaver()

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
        with self._watched("optimizer step"):
            metrics = self._optimizer_step()  # gradients stay allocated for the next mini-batch; scoring frees them
        grad_norm = metrics["raw_grad_norm"]
        return None if grad_norm != grad_norm else float(grad_norm)

    def get_lr(self) -> float:
        return current_lr(self.optimizer) or 0.0

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir, tokenizer=None):
        """The checkpoint of the current state at `ckpt_dir`: written before returning, or with
        ``async_save`` staged and written in the background (`finalize_pending_saves` publishes it).
        State a colocated run parked in host memory comes back for the save. A background save's host
        copies of the state's storages are lent to the offloader: a colocated trainer offloads right after
        the save, and parks the state in them instead of copying it again."""
        arguments = dict(
            step=int(self.scheduler.num_steps),
            extra={"skipped_steps": self.skipped_steps},
            tokenizer=tokenizer,  # inside the atomic save
        )
        with self._watched("checkpoint save", long_waits=True), self.model_resident(optimizer=True):
            if self.megatron_cfg.async_save:
                self.background_saves.save(ckpt_dir, self.built.chunks, self.optimizer, self.scheduler,
                                           storage_owners=self.offloader.storage_owners(self.optimizer), **arguments)
                self.offloader.lend(self.background_saves.storage_copies)
                self.last_save_timings = self.background_saves.last_timings
            else:
                self.background_saves.finalize()  # (none is in flight unless async_save changed)
                started = time.perf_counter()
                save_checkpoint(ckpt_dir, self.built.chunks, self.optimizer, self.scheduler, **arguments)
                self.last_save_timings = SaveTimings(write_s=time.perf_counter() - started)

    def save_timings(self) -> dict[str, float]:
        """This rank's `SaveTimings` of its last `save_checkpoint` (all zero before the first)."""
        return dataclasses.asdict(getattr(self, "last_save_timings", SaveTimings()))

    def background_write_done(self) -> bool:
        """Whether this rank's files of the save in flight are written (True when none is in flight)."""
        return self.background_saves.write_done()

    def finalize_pending_saves(self) -> str | None:
        """Wait for the checkpoint written in the background and publish it (collective); its path, or None
        when none was in flight. skyrl 0.4's trainer calls it when training ends; ours
        (`trainer_faults.py`) before it points the host at a checkpoint."""
        with self._watched("checkpoint save", long_waits=True):
            path = self.background_saves.finalize()
        return None if path is None else str(path)

    def load_checkpoint(self, ckpt_dir, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True):
        self.finalize_pending_saves()  # a save of this worker in flight is complete before anything loads
        with self._watched("checkpoint load", long_waits=True):
            return self._load_checkpoint(ckpt_dir, load_optimizer_states, load_lr_scheduler_states)

    def _load_checkpoint(self, ckpt_dir, load_optimizer_states: bool, load_lr_scheduler_states: bool):
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
