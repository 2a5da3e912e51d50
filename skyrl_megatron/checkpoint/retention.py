"""Old checkpoints deleted in the background (``trainer.max_ckpts_to_keep``), off the training step.

The hosts delete old checkpoints inside `save_checkpoints`, by a Ray task on every node that holds
workers. Ray keeps no idle worker for such a task, so each deletion starts a Python process that imports
the host: 7.6 s per save on an H200 machine (median of a 0.6B run), more than the rest of a background save.
Here the deletion runs in a thread of the driver, on the driver's node by a plain call and on every other
node by a Ray task, while training goes on.

Only complete checkpoints are counted (steps up to the newest complete one the caller names: a save in
flight is never one of them). A retired checkpoint is first renamed out of the hosts' ``global_step_<N>``
pattern (at once, by the caller), then removed (in the thread): a deletion cut short leaves a hidden
``.global_step_<N>.removing`` that nothing resumes, never a half-deleted checkpoint under its own name, and
the next save's free-space check (`space.py`) counts what is set aside as freed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from skyrl_megatron.checkpoint.latest import STEP_PREFIX, saved_steps, step_dir

logger = logging.getLogger(__name__)

REMOVING_SUFFIX = ".removing"


def retired_steps(root: str | os.PathLike, keep: int, newest_complete: int) -> list[int]:
    """The steps whose checkpoints `keep` retires: the complete ones (steps up to `newest_complete`) but
    the newest `keep` (the hosts' meaning of ``max_ckpts_to_keep``: negative keeps all, 0 keeps none)."""
    if keep < 0:
        return []
    complete = [step for step in saved_steps(root) if step <= newest_complete]
    return complete[: max(len(complete) - keep, 0)]


def set_aside_retired(root: str | os.PathLike, keep: int, newest_complete: int) -> list[int]:
    """Rename the checkpoints `retired_steps` names under `root` out of the hosts' pattern (instant: nothing
    resumes them from here on, and a save's free-space check counts them as freed); the steps."""
    set_aside = []
    for step in retired_steps(root, keep, newest_complete):
        directory = step_dir(root, step)
        try:
            os.rename(directory, directory.with_name(f".{STEP_PREFIX}{step}{REMOVING_SUFFIX}"))
        except FileNotFoundError:  # another node's task moved it on a shared file system
            continue
        set_aside.append(step)
    return set_aside


def being_removed(root: str | os.PathLike) -> list[Path]:
    """The checkpoints set aside for deletion under `root` (also those a process left unfinished)."""
    return sorted(Path(root).glob(f".{STEP_PREFIX}*{REMOVING_SUFFIX}"))


def remove_retired(root: str | os.PathLike, keep: int, newest_complete: int) -> list[int]:
    """Set aside and delete what `max_ckpts_to_keep` retires under `root` on this machine; the steps. Runs
    wherever the files are (a Ray task on another node): it imports nothing heavy."""
    steps = set_aside_retired(root, keep, newest_complete)
    _delete_set_aside(root, ignore_errors=True)
    return steps


def _delete_set_aside(root: str | os.PathLike, *, ignore_errors: bool) -> None:
    for directory in being_removed(root):
        shutil.rmtree(directory, ignore_errors=ignore_errors)


class BackgroundRetention:
    """The driver's deletions of old checkpoints, one at a time: set aside at once, removed in a thread."""

    def __init__(self, root: str | os.PathLike, keep: int) -> None:
        self.root = str(root)
        self.keep = keep
        self._thread: threading.Thread | None = None
        self.removed: list[int] = []

    def start(self, newest_complete: int) -> float:
        """Retire what `max_ckpts_to_keep` retires once `newest_complete` is complete: set aside here and now,
        deleted in the background; the seconds spent waiting for the deletion before (normally none)."""
        waited = self.wait()
        if self.keep >= 0:
            try:
                self.removed = set_aside_retired(self.root, self.keep, newest_complete)
            except OSError as exc:
                logger.warning("setting aside checkpoints older than step %d under %s failed: %s", newest_complete,
                               self.root, exc)
            self._thread = threading.Thread(target=self._run, args=(newest_complete,), name="checkpoint-retention",
                                            daemon=True)
            self._thread.start()
        return waited

    def wait(self) -> float:
        """Wait for the deletion in progress, if any; the seconds waited."""
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return time.perf_counter() - started

    def _run(self, newest_complete: int) -> None:
        try:
            _delete_set_aside(self.root, ignore_errors=False)  # a failure here is reported
            _on_other_nodes(remove_retired, self.root, self.keep, newest_complete)
        except Exception as exc:  # noqa: BLE001 - a failed deletion must not end the training
            logger.warning("deleting checkpoints older than step %d under %s failed: %s", newest_complete, self.root,
                           exc)


def _on_other_nodes(fn, *args) -> None:
    """`fn(*args)` on every other alive node of the Ray cluster (where a node-local `ckpt_path` keeps
    copies), waiting for all."""
    import ray

    if not ray.is_initialized():
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    others = [node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
    task = ray.remote(num_cpus=0)(fn)
    ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
             for node in others])
