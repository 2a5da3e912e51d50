"""Driver side: start Ray the way the host does (plus what a CPU run needs) and run the host trainer."""

from __future__ import annotations

import os

from skyrl_megatron.activation import STRATEGY, activate
from skyrl_megatron.hosts import current


def initialize_ray(cfg, log_to_driver: bool = True, quiet: bool = False) -> None:
    """The host's Ray start (its runtime environment, its registries), plus what a CPU run needs.

    On the CPU runtime Ray is told of as many *logical* GPUs as the workers will ask for: the host's
    actor groups and placement groups request GPUs, and Ray schedules them only where it believes
    GPUs exist. Every Ray process is put on our CPU runtime. `quiet` keeps Ray's own start-up lines
    and its metrics exporter (nothing collects it in a local run) off the console.
    """
    import logging

    import ray

    from skyrl_megatron.failures import start_registry
    from skyrl_megatron.runtime import RUNTIME_ENV_VAR

    activate()
    host = current()
    view = host.our_view(cfg)
    on_cpu = runs_on_cpu(view)
    env_vars = host.ray_env_vars(cfg, on_cpu=on_cpu)
    resources: dict[str, int] = {}
    if on_cpu:
        env_vars[RUNTIME_ENV_VAR] = "cpu"
        resources = cpu_cluster_resources(view)
    # The host pins TE's attention backend for its own Megatron path (NVTE_FUSED_ATTN=0 with
    # flash_attn); Megatron-Core then refuses its default attention_backend=auto. Ours is chosen by
    # the layer spec, and users choose TE's through transformer_config_kwargs.attention_backend.
    for name in [name for name in env_vars if name.startswith("NVTE_")]:
        del env_vars[name]
    if quiet:
        # Ray's config flag, read by the raylet, GCS and workers this init starts: nothing collects
        # metrics in a local run, and each process would report that it found no exporter
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        host.without_metrics_scraping(cfg)  # the host's scraper of Ray's (now absent) metrics agents
    logging_level = logging.WARNING if quiet else logging.INFO
    ray.init(runtime_env={"env_vars": env_vars}, log_to_driver=log_to_driver, logging_level=logging_level, **resources)
    host.sync_registries()
    start_registry()


def runs_on_cpu(view) -> bool:
    """`view`: the config in our shape (``hosts.current().our_view(cfg)``)."""
    from skyrl_megatron.runtime import Device, resolve_device

    megatron = view.trainer.policy.get("megatron_config") or {}
    return view.trainer.strategy == STRATEGY and resolve_device(megatron.get("runtime")) is Device.CPU


def cpu_cluster_resources(view) -> dict[str, int]:
    """Logical GPUs for every worker actor; CPUs for those, the CPU engines and the trainer task."""
    from skyrl_megatron.config import active_roles, role_world_size

    gpus = sum(role_world_size(view, role) for role in active_roles(view))
    engines = view.generator.num_inference_engines if view.generator.get("engine", "auto") == "cpu" else 0
    # logical CPUs, like the GPUs: Ray warns once its worker processes outnumber them, and a run holds
    # an actor per worker and engine plus Ray's own helpers
    return {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, 2 * (gpus + engines + 1))}


def run_experiment(
    cfg, experiment_cls=None, *, in_driver: bool = False, log_to_driver: bool = True, quiet: bool = False
) -> None:
    """Start Ray and run the host trainer.

    By default the trainer runs in a Ray task, as the host's own main does (the driver may sit on a
    small head node). `in_driver` runs it in this process instead, so its progress bar and prints
    reach the terminal directly. A worker process that dies is reported as a
    :class:`~skyrl_megatron.failures.WorkerFailure` naming its role, rank and mesh coordinates; a
    worker's own report (out of memory, with the keys to turn; a hang its watchdog named) is raised as
    itself. `trainer.preemption_signal` to this process stops the run after its step with a checkpoint
    (:class:`~skyrl_megatron.failures.Preempted`).
    """
    import ray

    from skyrl_megatron import preemption
    from skyrl_megatron.failures import reported_failure

    initialize_ray(cfg, log_to_driver=log_to_driver, quiet=quiet)
    handler = preemption.install(current().our_view(cfg).trainer.get("preemption_signal"))
    try:
        if in_driver:
            _run_experiment_in_task(cfg, experiment_cls)
        else:
            ray.get(_experiment_task.remote(cfg, experiment_cls))
    except ray.exceptions.RayTaskError as error:
        reported = reported_failure(error)
        if reported is None:
            raise
        raise reported from None  # the worker's message alone, not Ray's remote traceback
    finally:
        if handler is not None:
            handler.uninstall()


def _run_experiment_in_task(cfg, experiment_cls=None) -> None:
    from skyrl_megatron.failures import explain, reported_failure
    from skyrl_megatron.trainer_faults import fault_handling_experiment

    activate()
    experiment_cls = fault_handling_experiment(experiment_cls or current().base_experiment_class())
    try:
        experiment_cls(cfg).run()
    except Exception as error:
        if reported_failure(error) is not None:
            raise  # a worker's own report: run_experiment unwraps it
        failure = explain(error)
        if failure is None:
            raise
        raise failure from error


class _LazyTask:
    """Creates the Ray remote function on first use, so importing this module never imports Ray."""

    _task = None

    def remote(self, *args, **kwargs):
        if self._task is None:
            import ray

            self._task = ray.remote(num_cpus=1)(_run_experiment_in_task)
        return self._task.remote(*args, **kwargs)


_experiment_task = _LazyTask()
