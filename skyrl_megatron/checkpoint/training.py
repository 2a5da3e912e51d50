"""Distributed checkpoints of a Megatron worker's training state: save and load.

A checkpoint directory holds

    skyrl_megatron_checkpoint.json   our metadata: format version, model identity, layout, step,
                                     the caller's `extra`, and the size of every shard file
    dist/                            a Megatron `dist_checkpointing` checkpoint: model chunks,
                                     optimizer, LR scheduler, per-rank RNG states
    huggingface/                     the tokenizer, when one is given

Model and optimizer state are stored in Megatron's global (layout-independent) form, so a
checkpoint saved under one parallel layout loads under another; the distributed optimizer saves
its state `fully_reshardable` for that reason. RNG states belong to ranks and are restored only
under the layout they were saved with. A model carrying LoRA adapters stores only the adapters
(its base is frozen and is rebuilt from the HF checkpoint); the metadata's `model_state` says which.

Saving is atomic: every rank writes into a `.<name>.partial` sibling, the metadata file is written
last, and rank 0 renames the directory into place after all ranks finished. An existing checkpoint
at the same path is replaced only then, so a crash mid-save leaves the previous one loadable.
Loading checks the metadata (model identity, files present with their recorded sizes) before it
reads a tensor, reads everything into fresh buffers, and copies into the model and optimizer only
once every rank has read its part.

Data-parallel (and context-parallel) replicas hold the same shards: each replica writes a share of
them at save, and reads a share at load and hands it to the others, instead of the first replica
writing everything and every replica reading everything. Saving starts no helper process, so a
rank killed mid-save leaves nothing running behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skyrl_megatron import state_changes
from skyrl_megatron.checkpoint.atomic import PARTIAL_SUFFIX, check_replaceable, commit, sibling, write_durably
from skyrl_megatron.checkpoint.errors import CheckpointError, CheckpointMismatchError
from skyrl_megatron.checkpoint.integrity import (
    DIST_SUBDIR,
    METADATA_FILE,
    CheckpointMetadata,
    Layout,
    ModelIdentity,
    check_files,
    check_model_state,
    check_same_model,
    check_shard_index,
    file_sizes,
    read_checkpoint_metadata,
    unwrap,
)
from skyrl_megatron.checkpoint.megatron_state import (
    agree_on_all_ranks,
    describe_optimizer,
    load_model_state,
    load_optimizer_state,
    load_strategy,
    model_state_of,
    optimizer_kind,
    restore_rng,
    sharded_training_state,
    use_fresh_buffers,
)
from skyrl_megatron.checkpoint.space import ensure_room
from skyrl_megatron.dist_io import fast_shard_bookkeeping, save_strategy, writer_errors, writer_results_in_process
from skyrl_megatron.master_weights import masters_materialised

logger = logging.getLogger(__name__)

TOKENIZER_SUBDIR = "huggingface"


@dataclass(frozen=True)
class CheckpointState:
    """What `load_checkpoint` restored besides the weights."""

    step: int
    extra: dict[str, Any]
    saved_layout: Layout
    rng_restored: bool  # only under the layout the checkpoint was saved with


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    tokenizer=None,
) -> Path:
    """Save model chunks, optimizer, scheduler and RNG states to `ckpt_dir` (collective, all ranks).

    `extra` must be JSON-serialisable; it is returned by `load_checkpoint`. A `tokenizer` is saved
    to `<ckpt_dir>/huggingface`, where the host's FSDP checkpoints keep it. An existing checkpoint
    at `ckpt_dir` is replaced once the new one is complete; any other non-empty directory there
    is refused. Returns the final path. (`async_save.AsyncCheckpointSaver` writes the same
    checkpoint in the background.)
    """
    target = begin_save(ckpt_dir, extra, tokenizer)
    with captured_state(chunks, optimizer, scheduler, step, extra) as (metadata, sharded):
        check_room(sharded, target)
        write_shards(sharded, target, in_background=False)  # returns after a barrier: every rank's shards are on disk
    return finish_save(target, metadata)


@dataclass(frozen=True)
class SaveTarget:
    """Where a save goes: `final`, once complete; until then every rank writes into `partial`."""

    final: Path
    partial: Path

    @property
    def dist_dir(self) -> Path:
        return self.partial / DIST_SUBDIR


def begin_save(ckpt_dir: str | os.PathLike, extra: dict[str, Any] | None, tokenizer) -> SaveTarget:
    """Checks before any collective, then a fresh partial directory (collective). A partial directory
    left by a save that crashed was never published: it is discarded."""
    final = Path(ckpt_dir).absolute()
    try:
        json.dumps(dict(extra or {}))
    except TypeError as exc:
        raise CheckpointError(f"save_checkpoint: `extra` must be JSON-serialisable ({exc})") from None
    check_replaceable(final, marker=METADATA_FILE, what="a skyrl-megatron checkpoint")
    target = SaveTarget(final, sibling(final, PARTIAL_SUFFIX))
    if dist.get_rank() == 0:
        shutil.rmtree(target.partial, ignore_errors=True)
        target.dist_dir.mkdir(parents=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(target.partial / TOKENIZER_SUBDIR)
    dist.barrier()
    return target


@contextlib.contextmanager
def captured_state(chunks, optimizer, scheduler, step: int, extra: dict[str, Any] | None):
    """The metadata of a save of the current state (its files still empty) and Megatron's sharded state
    dict of it, for the block (collective). Compact master weights are saved as the fp32 masters they
    stand for (the same checkpoint either way): those exist only inside the block, which must change no
    state (the masters then go back to the remainders they had)."""
    model_state = model_state_of(chunks)  # collective: every rank takes part
    metadata = CheckpointMetadata(
        step=int(step),
        extra=dict(extra or {}),
        model=ModelIdentity.of(chunks),
        layout=Layout.current(chunks),
        optimizer=None if optimizer is None else optimizer_kind(optimizer),
        has_scheduler=scheduler is not None,
        files={},
        model_state=model_state,
    )
    with masters_materialised(optimizer, read_only=True):
        yield metadata, sharded_training_state(
            chunks, optimizer, scheduler, is_loading=False, with_rng=True, model_state=model_state
        )


def check_room(sharded: dict, target: SaveTarget) -> None:
    """Refuse a save that would not fit on a node's disk (`space.ensure_room`; collective), its partial
    directory removed."""
    try:
        ensure_room(sharded, target.final)
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(target.partial, ignore_errors=True)
        raise


def write_shards(sharded: dict, target: SaveTarget, *, in_background: bool, strategy=None, validate: bool = True):
    """Megatron's save of `sharded` into `target` (collective; after `check_room`): written now, or
    (`in_background`) only planned, the write and its finalisation returned as Megatron's AsyncRequest.
    `strategy`: Megatron's save strategy (a fresh `save_strategy()` by default); `validate`: Megatron's check
    that every shard is written exactly once (`validate_access_integrity`), which a series of saves of one
    structure needs only once."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    with writer_results_in_process(), fast_shard_bookkeeping(), writer_errors() as logged:
        try:
            return dist_checkpointing.save(sharded, str(target.dist_dir), sharded_strategy=strategy or save_strategy(),
                                           validate_access_integrity=validate, async_sharded_save=in_background,
                                           async_strategy="mcore")
        # torch.distributed.checkpoint reports write failures as a BaseException subclass
        except (Exception, CheckpointException) as exc:
            if not logged:
                raise
            raise CheckpointError(f"writing {target.final} failed: {'; '.join(logged)}; the previous checkpoint "
                                  "stays in place") from exc


def finish_save(target: SaveTarget, metadata: CheckpointMetadata) -> Path:
    """After every rank's shards and the shard index are written: the metadata file (last) with the files'
    sizes, the shard index checked against the files, then the rename into place (collective)."""
    if dist.get_rank() == 0:
        written = dataclasses.replace(metadata, files=file_sizes(target.dist_dir))
        write_durably(target.partial / METADATA_FILE, written.to_json())
    # every rank learns whether the written checkpoint is whole before it is published
    agree_on_all_ranks(lambda: check_shard_index(target.partial) if dist.get_rank() == 0 else None,
                       f"checkpoint {target.final} was written incompletely")
    commit(target.partial, target.final)
    return target.final


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    strict: bool = True,
) -> CheckpointState:
    """Load a checkpoint written by `save_checkpoint` into `chunks` (and `optimizer`, `scheduler`
    when given). Collective: all ranks call it. The current layout may differ from the saved one.

    Raises CheckpointNotFoundError, CorruptCheckpointError or CheckpointMismatchError before any
    weight is touched. With strict=False, tensors missing from the checkpoint keep their values.
    """
    state_changes.record()
    # compact master weights: the fp32 masters take the saved values, then are released against the
    # loaded model weights
    with masters_materialised(optimizer):
        return _load_checkpoint(ckpt_dir, chunks, optimizer, scheduler, strict=strict)


def _load_checkpoint(ckpt_dir, chunks, optimizer, scheduler, *, strict: bool) -> CheckpointState:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    path = Path(ckpt_dir).absolute()
    metadata = read_checkpoint_metadata(path)
    check_same_model(metadata, chunks, path)
    check_model_state(metadata, model_state_of(chunks), path)  # collective
    check_files(metadata, path)
    if optimizer is not None and metadata.optimizer != optimizer_kind(optimizer):
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {describe_optimizer(metadata.optimizer)}, but the optimizer to "
            f"restore is {describe_optimizer(optimizer_kind(optimizer))}; set "
            f"ddp_config.use_distributed_optimizer as when it was saved, or load without the optimizer"
        )
    if scheduler is not None and not metadata.has_scheduler:
        raise CheckpointMismatchError(f"checkpoint {path} holds no LR scheduler state")

    layout = Layout.current(chunks)
    same_layout = layout == metadata.layout
    sharded = sharded_training_state(
        chunks, optimizer, scheduler, is_loading=True, with_rng=same_layout, model_state=metadata.model_state
    )
    use_fresh_buffers(sharded)
    failure = f"cannot read checkpoint {path}"
    with fast_shard_bookkeeping():
        loaded = agree_on_all_ranks(
            lambda: dist_checkpointing.load(
                sharded,
                str(path / DIST_SUBDIR),
                sharded_strategy=load_strategy(failure),
                strict=StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED,
            ),
            failure,
        )

    # every rank holds its complete state now: only copies from here on
    for index, chunk in enumerate(chunks):
        load_model_state(unwrap(chunk), loaded[f"model{index}"], metadata.model_state, strict=strict)
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"])
    if scheduler is not None:
        # load_state_dict advances by the saved step count instead of setting it
        scheduler.num_steps = 0
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        restore_rng(loaded["rng_state"])
    else:
        logger.warning(
            "checkpoint %s was saved under %s; running under %s: RNG states are per rank and are not "
            "restored (model, optimizer and scheduler state are)",
            path,
            metadata.layout,
            layout,
        )
    return CheckpointState(
        step=metadata.step, extra=metadata.extra, saved_layout=metadata.layout, rng_restored=same_layout
    )
