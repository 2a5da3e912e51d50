"""The host's trainer without generation: its actor groups and dispatch, for tests on CPU.

`RayPPOTrainer.build_models` is where the host creates its worker groups (placement groups,
`PPORayActorGroup`, the mesh ranks `MeshDispatch` plans with) and initialises the models;
`fwd_logprobs_values_reward` and `train_critic_and_policy` are its scoring and training phases.
None of them touches the dataset, the inference engines or the generator, so a trainer built
without those runs exactly the host code a real run takes between two generation steps.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch


def start_ray_for_cpu_workers(num_gpus: int, num_cpus: int, object_store_mb: int = 256) -> None:
    """Start a local Ray with `num_gpus` *logical* GPUs and every Ray process on our CPU runtime.

    Our actor classes ask for one GPU each, as on a GPU cluster, and the host's placement groups
    bundle GPUs; Ray schedules them only where it believes GPUs exist, so the CPU box declares
    them. `activate()` first, so its `ray.init` wrapper activates every Ray worker process.
    """
    import ray

    from skyrl_megatron.activation import activate
    from skyrl_megatron.runtime import RUNTIME_ENV_VAR

    activate()
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=object_store_mb * 2**20,
        include_dashboard=False,
        runtime_env={"env_vars": {RUNTIME_ENV_VAR: "cpu"}},
    )


def training_input(batch: Mapping[str, torch.Tensor], response_length: int, global_step: int = 0, **metadata):
    """A host `TrainingInputBatch` with the metadata its workers (and, with `metadata`, its trainer) read."""
    from skyrl_megatron.hosts import current

    data = current().training_input_class()({k: v.clone() for k, v in batch.items()})
    data.metadata = {"response_length": response_length, "global_step": global_step, **metadata}
    return data


def host_trainer(cfg, tokenizer, total_training_steps: int) -> Any:
    """A `RayPPOTrainer` with no dataset, tracker, inference engines or generator."""
    from skyrl_megatron.hosts import current

    class _TrainerWithoutData(current().trainer_class()):
        def _build_train_dataloader_and_compute_training_steps(self):
            # the host's hook for custom dataloaders; the step count sizes the workers' LR schedule
            self.train_dataloader = None
            self.total_training_steps = total_training_steps

    return _TrainerWithoutData(
        cfg, tracker=None, tokenizer=tokenizer, train_dataset=None, inference_engine_client=None, generator=None
    )


def build_worker_groups(trainer) -> None:
    """The host's `build_models` with the worker classes it picks for `trainer.strategy=megatron`."""
    from skyrl_megatron.activation import STRATEGY
    from skyrl_megatron.hosts import current

    policy, critic, ref = current().worker_classes(STRATEGY)
    trainer.build_models(policy, critic, ref)


@contextlib.contextmanager
def trainer_with_workers(cfg, model_dir: str, *, num_gpus: int, num_cpus: int = 2,
                         total_training_steps: int = 10) -> Iterator[Any]:
    """Ray for CPU workers, then the host's trainer on `cfg` (tokenizer from `model_dir`) with its worker
    groups built; Ray shuts down after the block."""
    import ray
    from transformers import AutoTokenizer

    start_ray_for_cpu_workers(num_gpus=num_gpus, num_cpus=num_cpus)
    try:
        trainer = host_trainer(cfg, AutoTokenizer.from_pretrained(model_dir), total_training_steps)
        build_worker_groups(trainer)
        yield trainer
    finally:
        ray.shutdown()
