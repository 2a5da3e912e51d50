"""The host trainer's pointer to its latest checkpoint, kept true when checkpoints are written in the background.

The hosts keep each step's checkpoint in ``<ckpt_path>/global_step_<N>/`` (a directory per worker
role, plus the trainer's ``trainer_state.pt`` and the data loader's ``data.pt``) and name the one to
resume in ``<ckpt_path>/latest_ckpt_global_step.txt``, written once the step's save calls returned.
A background save returns before its files exist, so the trainer (``trainer_faults.py``) writes the
pointer itself, once the workers have published the save (`publish_latest`).

A job killed in between (after the host wrote the pointer, before it was put back) would leave it
naming a checkpoint that never completed; `repair_latest`, run before the host resumes, points it
at the newest complete checkpoint before that one instead and sets the incomplete ones after it aside.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from skyrl_megatron.checkpoint.atomic import write_durably
from skyrl_megatron.checkpoint.errors import CheckpointError
from skyrl_megatron.checkpoint.integrity import verify_checkpoint

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_ckpt_global_step.txt"  # the hosts' name
STEP_PREFIX = "global_step_"
TRAINER_STATE_FILE = "trainer_state.pt"  # written by the host's trainer, after the workers' checkpoints
INCOMPLETE_SUFFIX = ".incomplete"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step}"


def read_latest(root: str | os.PathLike) -> int | None:
    """The step the pointer names, or None when there is no pointer."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold a step number, not {text[:40]!r}") from None


def publish_latest(root: str | os.PathLike, step: int | None) -> None:
    """Point the host at `step` (None: remove the pointer), atomically: the file is written beside it
    and renamed over it, so a reader sees the old pointer or the new one."""
    path = Path(root) / LATEST_FILE
    if step is None:
        path.unlink(missing_ok=True)
        return
    scratch = path.with_name(f".{LATEST_FILE}.writing")
    write_durably(scratch, str(int(step)))
    os.replace(scratch, path)


def incomplete_reason(root: str | os.PathLike, step: int, roles: Sequence[str]) -> str | None:
    """Why the checkpoint of `step` cannot be resumed (None: it can): every role's checkpoint verifies
    (metadata, files and shard index) and the host's trainer state is there."""
    directory = step_dir(root, step)
    for role in roles:
        try:
            verify_checkpoint(directory / role)
        except CheckpointError as exc:
            return f"{role}: {exc}"
    if not (directory / TRAINER_STATE_FILE).is_file():
        return f"{TRAINER_STATE_FILE} is missing"
    return None


def saved_steps(root: str | os.PathLike) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for entry in root.iterdir() if entry.is_dir() and (m := _STEP_DIR.match(entry.name)))


def repair_latest(root: str | os.PathLike, roles: Sequence[str]) -> str | None:
    """Where the pointer names a checkpoint that cannot be resumed, make it name the newest complete one
    before it (or remove it when there is none) and set the incomplete ones after that aside (renamed
    ``.global_step_<N>.incomplete``); what was changed, or None when the pointer was right. A pointer
    naming a complete checkpoint is left as it is."""
    root = Path(root)
    pointed = read_latest(root)
    if pointed is None:
        return None
    problem = incomplete_reason(root, pointed, roles)
    if problem is None:
        return None
    steps = saved_steps(root)
    reasons = {step: incomplete_reason(root, step, roles) for step in steps}
    complete = [step for step in steps if reasons[step] is None and step < pointed]
    newest = complete[-1] if complete else None
    incomplete = {step: reasons[step] for step in steps if reasons[step] is not None and (newest is None or step > newest)}
    incomplete.setdefault(pointed, problem)
    for step in sorted(incomplete):
        if not step_dir(root, step).exists():
            continue
        aside = root / f".{STEP_PREFIX}{step}{INCOMPLETE_SUFFIX}"
        if aside.exists():
            aside = root / f".{STEP_PREFIX}{step}{INCOMPLETE_SUFFIX}.{os.getpid()}"
        os.rename(step_dir(root, step), aside)
    publish_latest(root, newest)
    message = (f"checkpoint pointer {root / LATEST_FILE}: {pointed} -> {newest}; incomplete checkpoints set aside: "
               + "; ".join(f"step {step} ({reason})" for step, reason in sorted(incomplete.items())))
    logger.warning(message)
    return message
