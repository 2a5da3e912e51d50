"""Which worker died: a registry of worker actors, and an error that names the failed rank.

When a worker process dies (OOM kill, segfault, a lost node), Ray reports an ``ActorDiedError`` with
an actor id, or a surviving rank fails first in a collective whose peer vanished. Neither names the
worker the user knows ("policy rank 1, TP 1"). Each worker therefore registers its role and mesh
coordinates in a small named actor when its process groups come up (our inference engines register
too, by index); on failure the driver asks the registry which registered workers are dead and raises
:class:`WorkerFailure` naming them.

The registry also carries what a worker found out itself and the driver must hear even if that
worker's process is gone by then: a hang its watchdog named (`report_failure`, raised by the driver
as :class:`CollectiveHang`); and the driver's request to stop after the current step (preemption,
`request_stop`), which the trainer reads wherever it runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)

REGISTRY_NAME = "skyrl_megatron_worker_registry"
# How long a liveness probe waits: a dead actor answers at once, a busy one is taken as alive.
_PROBE_SECONDS = 10.0


@dataclass(frozen=True)
class WorkerIdentity:
    role: str
    rank: int
    world_size: int
    coordinates: str  # e.g. "dp 0, cp 0, tp 1, pp 0"
    pid: int
    node_ip: str

    def __str__(self) -> str:
        where = f"pid {self.pid} on {self.node_ip}"
        if not self.coordinates:  # an inference engine: no mesh
            return f"{self.role} {self.rank} of {self.world_size} ({where})"
        return f"{self.role} worker rank {self.rank}/{self.world_size} ({self.coordinates}; {where})"


class ReportedFailure(RuntimeError):
    """Training stopped for a reason its message states in full (which worker, what to change).

    Raised in a worker or task, it reaches the driver wrapped in Ray's `RayTaskError`, whose text
    is the remote traceback; `reported_failure` unwraps it so the user sees the message alone.
    """


class WorkerFailure(ReportedFailure):
    """Training stopped because worker processes died; the message names them."""


class CollectiveHang(ReportedFailure):
    """A collective of a worker call was left waiting by ranks that did not join it (watchdog.py); the
    message names the call and those ranks."""


class Preempted(ReportedFailure):
    """The run stopped on a preemption signal after writing a checkpoint (not a failure: rerunning resumes);
    the driver exits with `exit_codes.PREEMPTED`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):  # through Ray's pickling with its step
        return (type(self), (str(self), self.step))


class EngineFailure(ReportedFailure):
    """An inference engine died (or failed) during generation or a weight sync; the message names it."""


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self):
        self.workers: dict[str, tuple[WorkerIdentity, object]] = {}
        self.reports: list[str] = []
        self.stop_request: str | None = None

    def register(self, actor_id: str, identity: WorkerIdentity, handle) -> None:
        self.workers[actor_id] = (identity, handle)

    def entries(self) -> dict[str, tuple[WorkerIdentity, object]]:
        return dict(self.workers)

    def report(self, message: str) -> None:
        if message not in self.reports:
            self.reports.append(message)

    def withdraw(self, message: str) -> None:
        if message in self.reports:
            self.reports.remove(message)

    def reported(self) -> list[str]:
        return list(self.reports)

    def request_stop(self, reason: str) -> None:
        self.stop_request = self.stop_request or reason

    def stop_requested(self) -> str | None:
        return self.stop_request


# the driver owns the registry (it lives exactly as long as the job's driver); its handle, with the Ray cluster
# it belongs to (a test may start several clusters in one process)
_DRIVER_HANDLE: tuple[str, object] | None = None


def start_registry() -> None:
    """Create the registry (driver side, after ray.init). Workers find it by name."""
    global _DRIVER_HANDLE
    handle = _Registry.options(name=REGISTRY_NAME, get_if_exists=True).remote()
    _DRIVER_HANDLE = (ray.get_runtime_context().gcs_address, handle)


def register_current_worker(role: str, rank: int, world_size: int, coordinates: str) -> None:
    """Called by each worker actor once its process groups exist.

    A no-op outside a Ray actor, or when the driver started no registry (e.g. a test that drives
    the host's actor groups itself).
    """
    if not ray.is_initialized():  # (asking for the runtime context would start a local Ray)
        return
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    if actor_id is None:
        return
    try:
        registry = ray.get_actor(REGISTRY_NAME)
    except ValueError:
        return
    identity = WorkerIdentity(role, rank, world_size, coordinates, os.getpid(), ray.util.get_node_ip_address())
    # Not waited for: the registry actor's process may still be starting (7 s of a CPU worker's start-up
    # was this wait), and a failure is looked up long after the call was submitted.
    registry.register.remote(actor_id, identity, context.current_actor)


def _registry():
    """The registry's handle, or None (no Ray, or no driver started one). The driver keeps its own handle:
    once the registry's actor has died, its name is gone, but calls through the handle say that it died."""
    if not ray.is_initialized():
        return None
    if _DRIVER_HANDLE is not None and _DRIVER_HANDLE[0] == ray.get_runtime_context().gcs_address:
        return _DRIVER_HANDLE[1]
    try:
        return ray.get_actor(REGISTRY_NAME)
    except ValueError:
        return None


def report_failure(message: str) -> None:
    """A worker's own account of a failure (a hang it found), kept for the driver: the worker's process
    may be gone by the time the driver asks (`explain`). Waits for the registry, briefly."""
    registry = _registry()
    if registry is None:
        return
    try:
        ray.get(registry.report.remote(message), timeout=_PROBE_SECONDS)
    except Exception as exc:  # noqa: BLE001 - the worker's own error still names the failure
        logger.warning("could not hand the failure report to the driver's registry: %s", exc)


def withdraw_failure(message: str) -> None:
    """Take back a report (`report_failure`) that turned out wrong: the hang ended after all."""
    registry = _registry()
    if registry is not None:
        with contextlib.suppress(Exception):
            ray.get(registry.withdraw.remote(message), timeout=_PROBE_SECONDS)


def reported_failures() -> list[str]:
    """The workers' failure reports, oldest first (driver side)."""
    registry = _registry()
    if registry is None:
        return []
    try:
        return ray.get(registry.reported.remote(), timeout=_PROBE_SECONDS)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return []


def request_stop(reason: str) -> None:
    """Ask the trainer to stop after its current step (the driver's preemption signal)."""
    registry = _registry()
    if registry is not None:
        ray.get(registry.request_stop.remote(reason), timeout=_PROBE_SECONDS)


def stop_requested() -> str | None:
    """Why the trainer should stop after its current step, or None (asked once per step)."""
    registry = _registry()
    if registry is None:
        return None
    try:
        return ray.get(registry.stop_requested.remote(), timeout=_PROBE_SECONDS)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None


def dead_workers() -> list[WorkerIdentity] | None:
    """Registered workers whose actor is dead, in role and rank order; None when the registry's own actor
    died (then nothing is left that knows who registered)."""
    registry = _registry()
    if registry is None:  # no registry was started
        return []
    try:
        entries = ray.get(registry.entries.remote(), timeout=_PROBE_SECONDS)
    except ray.exceptions.GetTimeoutError:
        return []
    except ray.exceptions.RayActorError:
        return None
    registered = list(entries.values())
    dead = _dead([handle for _, handle in registered])
    return sorted((identity for (identity, _), is_dead in zip(registered, dead) if is_dead),
                  key=lambda identity: (identity.role, identity.rank))


def _dead(handles: list) -> list[bool]:
    """For each actor handle, whether its actor is dead (one that does not answer in time: alive, busy)."""
    if not handles:
        return []
    probes = {handle.__ray_ready__.remote(): index for index, handle in enumerate(handles)}
    ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=_PROBE_SECONDS)
    dead = [False] * len(handles)
    for ref in ready:
        try:
            ray.get(ref)
        # (Ray's memory monitor kills an actor's process and reports it as OutOfMemoryError, not RayActorError)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError):
            dead[probes[ref]] = True
    return dead


def dead_actors(handles: list, fallback_names: list[str]) -> list[str]:
    """The dead ones among `handles`, by their registered identity (pid, node) where they registered,
    else by `fallback_names`."""
    dead = _dead(list(handles))
    registered: dict[str, WorkerIdentity] = {}
    registry = _registry()
    if registry is not None and any(dead):
        try:
            registered = {actor_id: identity for actor_id, (identity, _) in
                          ray.get(registry.entries.remote(), timeout=_PROBE_SECONDS).items()}
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass
    return [str(registered.get(handle._actor_id.hex(), name))
            for handle, name, is_dead in zip(handles, fallback_names, dead) if is_dead]


def reported_failure(error: BaseException) -> ReportedFailure | None:
    """The `ReportedFailure` that `error` is or wraps (Ray's `RayTaskError` keeps it as `cause`), else None."""
    while error is not None:
        if isinstance(error, ReportedFailure) and not isinstance(error, ray.exceptions.RayTaskError):
            return error
        error = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
    return None


def explain(error: BaseException) -> ReportedFailure | None:
    """What made `error` happen, if a worker reported it (a hang: CollectiveHang) or worker or engine
    processes died (WorkerFailure naming them); else None."""
    reports = reported_failures()
    dead = dead_workers()
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if dead is None:
        # the registry holds no training state and does no work: it dies with the others only when something
        # outside the training ends Ray's processes
        return WorkerFailure(
            "Ray's worker processes died together, the failure registry's among them: something outside the "
            "training ended them, most often the host running out of memory (see `dmesg` and Ray's logs under "
            f"/tmp/ray/session_latest/logs). First error seen: {first_line}")
    names = "; ".join(str(identity) for identity in dead)
    if reports:
        died = f" Dead processes: {names}." if dead else ""
        return CollectiveHang(" ".join(reports) + died)
    if not dead:
        return None
    return WorkerFailure(f"{len(dead)} process(es) died: {names}. First error seen: {first_line}"
                         + (HOST_MEMORY_HINT if isinstance(error, ray.exceptions.OutOfMemoryError) else ""))


HOST_MEMORY_HINT = (
    " Ray's memory monitor ended them: the node's host memory ran out. What a run keeps there: the model and "
    "optimizer state that colocated workers offload between phases (trainer.placement.colocate_all), and with "
    "megatron_config.async_save a pinned copy of each rank's checkpoint; a node with more memory, more nodes, "
    "or async_save=false fit in less."
)
