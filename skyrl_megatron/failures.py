"""Which worker died: a registry of worker actors, and an error that names the failed rank.

When a worker process dies (OOM kill, segfault, a lost node), Ray reports an ``ActorDiedError`` with
an actor id, or a surviving rank fails first in a collective whose peer vanished. Neither names the
worker the user knows ("policy rank 1, TP 1"). Each worker therefore registers its role and mesh
coordinates in a small named actor when its process groups come up; on failure the driver asks the
registry which registered workers are dead and raises :class:`WorkerFailure` naming them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

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
        return (f"{self.role} worker rank {self.rank}/{self.world_size} ({self.coordinates}; "
                f"pid {self.pid} on {self.node_ip})")


class ReportedFailure(RuntimeError):
    """Training stopped for a reason its message states in full (which worker, what to change).

    Raised in a worker or task, it reaches the driver wrapped in Ray's `RayTaskError`, whose text
    is the remote traceback; `reported_failure` unwraps it so the user sees the message alone.
    """


class WorkerFailure(ReportedFailure):
    """Training stopped because worker processes died; the message names them."""


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self):
        self.workers: dict[str, tuple[WorkerIdentity, object]] = {}

    def register(self, actor_id: str, identity: WorkerIdentity, handle) -> None:
        self.workers[actor_id] = (identity, handle)

    def entries(self) -> dict[str, tuple[WorkerIdentity, object]]:
        return dict(self.workers)


_DRIVER_HANDLE = None  # the driver owns the registry: it lives exactly as long as the job's driver


def start_registry() -> None:
    """Create the registry (driver side, after ray.init). Workers find it by name."""
    global _DRIVER_HANDLE
    _DRIVER_HANDLE = _Registry.options(name=REGISTRY_NAME, get_if_exists=True).remote()


def register_current_worker(role: str, rank: int, world_size: int, coordinates: str) -> None:
    """Called by each worker actor once its process groups exist.

    A no-op outside a Ray actor, or when the driver started no registry (e.g. a test that drives
    the host's actor groups itself).
    """
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


def dead_workers() -> list[WorkerIdentity]:
    """Registered workers whose actor is dead, in role and rank order."""
    try:
        entries = ray.get(ray.get_actor(REGISTRY_NAME).entries.remote(), timeout=_PROBE_SECONDS)
    except (ValueError, ray.exceptions.GetTimeoutError):  # no worker ever registered
        return []
    probes = {handle.__ray_ready__.remote(): identity for identity, handle in entries.values()}
    ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=_PROBE_SECONDS)
    dead = []
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            dead.append(probes[ref])
    return sorted(dead, key=lambda identity: (identity.role, identity.rank))


def reported_failure(error: BaseException) -> ReportedFailure | None:
    """The `ReportedFailure` that `error` is or wraps (Ray's `RayTaskError` keeps it as `cause`), else None."""
    while error is not None:
        if isinstance(error, ReportedFailure) and not isinstance(error, ray.exceptions.RayTaskError):
            return error
        error = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else None
    return None


def explain(error: BaseException) -> WorkerFailure | None:
    """A WorkerFailure naming the dead workers if `error` came from one dying, else None."""
    dead = dead_workers()
    if not dead:
        return None
    names = "; ".join(str(identity) for identity in dead)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return WorkerFailure(f"{len(dead)} worker process(es) died: {names}. First error seen: {first_line}")
