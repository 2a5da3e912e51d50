"""The host's trainer with our fault handling: background checkpoints made the latest only once complete,
preemption at a step's end, and the latest pointer put right before a resume.

`launch.run_experiment` gives every trainer the host builds (the host's own or a subclass, e.g. the demo's)
these behaviours by subclassing its class (`with_fault_handling`); they override methods both hosts'
`RayPPOTrainer`s share:

- ``save_checkpoints``: with ``megatron_config.async_save`` the workers' saves return while their files are
  written. The save before is finished first (the workers' ``finalize_pending_saves``); the host's own
  pointer (``latest_ckpt_global_step.txt``), which it writes as soon as the save calls returned, is put
  back to the last complete checkpoint; both happen once the workers have published the save: as soon as
  every rank's files are written (checked as the next step's training starts, timed as
  ``checkpoint_publish``), else at the next save, at the end of training, or on preemption. A crash after
  that resumes from it, and ``max_ckpts_to_keep`` frees the disk of the older ones that much sooner.
- old checkpoints (``max_ckpts_to_keep``): with our workers, deleted in a background thread once the newest
  save is complete (`checkpoint.retention`), instead of by the host's per-node Ray tasks inside the save
  step; the run waits for the deletion at its end.
- every save step with our workers: their own account of it (`checkpoint.SaveTimings`, the slowest rank's)
  joins the step's timings beside the host's ``save_checkpoints``: ``checkpoint_finish_previous``,
  ``checkpoint_previous_write``, ``checkpoint_capture`` (background saves), ``checkpoint_write`` (synchronous
  ones), and ``checkpoint/staged_gib``; the host's ``cleanup_old_checkpoints`` is the wait for the deletion
  before (normally none).
- ``load_checkpoints``: a job killed between the host's pointer and ours may name a checkpoint that never
  completed; before resuming, the pointer is made to name the newest complete one
  (`checkpoint.latest.repair_latest`).
- preemption (`preemption.py`): once a stop was requested, the step's checkpoint is saved where the host
  saves its own (after training, before the weight sync) or, when the request came later, at the step's
  end; at the end of the step the save is finished and `failures.Preempted` ends the run.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Any

from skyrl_megatron.checkpoint.latest import publish_latest, read_latest, repair_latest
from skyrl_megatron.checkpoint.retention import BackgroundRetention
from skyrl_megatron.failures import Preempted
from skyrl_megatron.hosts import current
from skyrl_megatron.preemption import stop_reason

logger = logging.getLogger(__name__)

STEP_METRIC = "trainer/global_step"  # both hosts log it once per step, at the step's end


class FaultHandling:
    """Mixed in before the host trainer's class (see the module docstring)."""

    def _setup_fault_handling(self) -> None:
        view = current().our_view(self.cfg)
        trainer = view.trainer
        self._ours = trainer.strategy == "megatron"
        self._ckpt_root = str(trainer.ckpt_path)
        self._roles = ["policy"] + (["critic"] if trainer.critic.model.get("path") else [])
        self._background_saves = self._ours and any(
            bool((trainer[role].get("megatron_config") or {}).get("async_save")) for role in self._roles
        )
        self._in_flight_step: int | None = None  # the step whose save the workers still write
        self._saved: tuple[int, Any] | None = None  # (step, what save_checkpoints returned)
        # our workers' runs delete old checkpoints in the background (`checkpoint.retention`), never the host
        self._retention = BackgroundRetention(self._ckpt_root, int(trainer.max_ckpts_to_keep)) if self._ours else None
        self._preempted = False
        self.tracker = _StepEndTracker(self.tracker, self._at_step_end)

    # -- checkpoints -------------------------------------------------------------------------------

    def save_checkpoints(self):
        if self._saved is not None and self._saved[0] == self.global_step:
            return self._saved[1]  # this step's is saved already (on preemption)
        if not self._background_saves:
            result = super().save_checkpoints()
            if self._ours:
                self._retire_old_checkpoints(newest_complete=self.global_step)
        else:
            self.finish_background_saves()
            complete = read_latest(self._ckpt_root)
            result = super().save_checkpoints()
            publish_latest(self._ckpt_root, complete)  # the host pointed at the save in flight
            self._in_flight_step = self.global_step
        if self._ours:
            self._record_save_timings()
        self._saved = (self.global_step, result)
        return result

    def _trained_groups(self) -> list:
        return [group for group in (self.policy_model, getattr(self, "critic_model", None)) if group is not None]

    def _record_save_timings(self) -> None:
        """The workers' `SaveTimings` of this save, the slowest rank's of each (the step waits for it)."""
        import ray

        slowest: dict[str, float] = {}
        for group in self._trained_groups():
            for timings in ray.get(group.async_run_ray_method("pass_through", "save_timings")):
                for name, value in timings.items():
                    slowest[name] = max(slowest.get(name, 0.0), value)
        self.all_metrics["checkpoint/staged_gib"] = slowest.pop("staged_gib", 0.0)
        for name, seconds in slowest.items():
            self.all_timings[f"checkpoint_{name.removesuffix('_s')}"] = seconds

    def _cleanup_old_checkpoints(self):
        if not self._ours:  # ours: `_retire_old_checkpoints`, once the save is complete
            super()._cleanup_old_checkpoints()

    def _retire_old_checkpoints(self, newest_complete: int) -> None:
        """Start deleting what `max_ckpts_to_keep` retires, in the background; the step waits only for the
        deletion before it, if that still runs (timed as the host's own deletion)."""
        self.all_timings["cleanup_old_checkpoints"] = self._retention.start(newest_complete)

    def finish_background_saves(self) -> None:
        """Wait until the workers have published the save in flight, then point the host at it and delete
        what `max_ckpts_to_keep` retires (nothing when no save is in flight)."""
        if self._in_flight_step is None:
            return
        import ray

        for group in self._trained_groups():
            ray.get(group.async_run_ray_method("pass_through", "finalize_pending_saves"))
        publish_latest(self._ckpt_root, self._in_flight_step)
        logger.info("checkpoint of step %d complete", self._in_flight_step)
        self._retire_old_checkpoints(newest_complete=self._in_flight_step)
        self._in_flight_step = None

    def _publish_written_save(self) -> None:
        """Publish the save in flight if every rank's files are written (a Ray round trip per worker while one
        is in flight; the publication itself is collective and cheap once the files exist)."""
        if self._in_flight_step is None:
            return
        import ray

        started = time.perf_counter()
        for group in self._trained_groups():
            if not all(ray.get(group.async_run_ray_method("pass_through", "background_write_done"))):
                return
        self.finish_background_saves()
        self.all_timings["checkpoint_publish"] = time.perf_counter() - started

    def finish_checkpoint_work(self) -> None:
        """At the end of a run: the save in flight published, the deletion of old checkpoints done."""
        self.finish_background_saves()
        if self._retention is not None:
            self._retention.wait()

    def load_checkpoints(self):
        if self._ours and getattr(self.resume_mode, "value", self.resume_mode) == "latest":
            repair_latest(self._ckpt_root, self._roles)
        return super().load_checkpoints()

    # -- preemption --------------------------------------------------------------------------------

    def train_critic_and_policy(self, data):
        self._publish_written_save()
        status = super().train_critic_and_policy(data)
        if stop_reason() is not None:
            self.save_checkpoints()  # where the host saves its own: the state it expects for a save
        return status

    def _at_step_end(self) -> None:
        reason = stop_reason()
        if reason is None or self._preempted:
            return
        self.save_checkpoints()  # (already saved when the request came before training ended)
        self.finish_checkpoint_work()
        step = self.global_step
        self._preempted = True
        # the step's metrics are logged: nothing is pending (skyrl 0.4 logs what is left when a run fails)
        self.all_metrics, self.all_timings = {}, {}
        raise Preempted(f"stopped after step {step} ({reason}); its checkpoint is "
                        f"{self._ckpt_root}/global_step_{step}: rerun the same command to resume from it", step)


class _StepEndTracker:
    """The host's tracker, calling `at_step_end` after the step's metrics are logged."""

    def __init__(self, tracker, at_step_end):
        self._tracker = tracker
        self._at_step_end = at_step_end

    def log(self, data, *args, **kwargs):
        result = self._tracker.log(data, *args, **kwargs)
        if STEP_METRIC in data:
            self._at_step_end()
        return result

    def __getattr__(self, name: str):
        return getattr(self._tracker, name)


@functools.cache
def _with_fault_handling_class(trainer_class: type) -> type:
    if inspect.iscoroutinefunction(trainer_class.train):  # skyrl 0.4
        async def train(self):
            result = await trainer_class.train(self)
            self.finish_checkpoint_work()
            return result
    else:
        def train(self):
            result = trainer_class.train(self)
            self.finish_checkpoint_work()
            return result
    return type(f"{trainer_class.__name__}WithFaultHandling", (FaultHandling, trainer_class), {"train": train})


def with_fault_handling(trainer):
    """`trainer` (built by the host) with the behaviours above."""
    trainer.__class__ = _with_fault_handling_class(type(trainer))
    trainer._setup_fault_handling()
    return trainer


def fault_handling_experiment(experiment_class: type) -> type:
    """`experiment_class` (the host's BasePPOExp or a subclass) whose trainer gets the behaviours above."""

    class FaultHandlingExperiment(experiment_class):
        def get_trainer(self, *args, **kwargs):
            return with_fault_handling(super().get_trainer(*args, **kwargs))

    FaultHandlingExperiment.__name__ = f"{experiment_class.__name__}WithFaultHandling"
    return FaultHandlingExperiment
