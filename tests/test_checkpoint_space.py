"""A full disk: a save that would not fit is refused before anything is written, on every rank, with the
fix named; checkpoints set aside for deletion count as freed; the estimate matches what a save writes
(real saves of a tiny Qwen3, distributed optimizer, DP=2 over gloo). A write that fails anyway names what
the writer hit, synchronously and in the background. An HF export is checked the same way against rank 0's disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skyrl_megatron.testing import run_on_ranks
from skyrl_megatron.testing.checkpoint_steps import TP2_SP, WORLD1, setup_training, train_step

pytestmark = pytest.mark.slow


def _saves_against_a_small_disk(rank, world, hf_dir, root):
    import shutil
    from collections import namedtuple

    import torch.distributed as dist

    from skyrl_megatron.checkpoint import CheckpointError, save_checkpoint, space
    from skyrl_megatron.checkpoint.integrity import DIST_SUBDIR

    built, optimizer, scheduler, micro_batches = setup_training(hf_dir, WORLD1, True)
    train_step(built.chunks, optimizer, scheduler, micro_batches)  # Adam's moments exist
    root = Path(root)
    first = root / "global_step_1" / "policy"
    save_checkpoint(first, built.chunks, optimizer, scheduler, step=1)
    dist.barrier()
    written = sum(p.stat().st_size for p in (first / DIST_SUBDIR).rglob("*") if p.is_file())

    # what the next save writes, as the check counts it (the same state: the same size)
    from skyrl_megatron.checkpoint.megatron_state import model_state_of, sharded_training_state

    sharded = sharded_training_state(built.chunks, optimizer, scheduler, is_loading=False, with_rng=True,
                                     model_state=model_state_of(built.chunks))
    mine = space.bytes_to_write(sharded)
    counted = [0] * world
    dist.all_gather_object(counted, mine)

    # a disk with room for half of it
    Usage = namedtuple("Usage", "total used free")
    monkey_free = sum(counted) // 2
    real_disk_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: Usage(10 * monkey_free, 9 * monkey_free, monkey_free)
    second = root / "global_step_2" / "policy"
    try:
        try:
            save_checkpoint(second, built.chunks, optimizer, scheduler, step=2)
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        dist.barrier()
        left_after_refusal = sorted(p.name for p in second.parent.iterdir()) if second.parent.exists() else []
        first_still = sorted(p.name for p in first.iterdir())

        # a retired checkpoint set aside beside it frees what the save lacks
        if rank == 0:
            aside = root / ".global_step_0.removing" / "policy"
            aside.mkdir(parents=True)
            with open(aside / "shard", "wb") as handle:
                handle.truncate(sum(counted))  # its size counts, not its blocks
        dist.barrier()
        save_checkpoint(second, built.chunks, optimizer, scheduler, step=2)
    finally:
        shutil.disk_usage = real_disk_usage
    return {"written": written, "counted": counted, "refused": refused, "left": left_after_refusal,
            "first": first_still, "second": sorted(p.name for p in second.iterdir())}


def test_a_save_that_does_not_fit_is_refused_before_writing(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=5))
    results = run_on_ranks(_saves_against_a_small_disk, 2, hf_dir, str(tmp_path / "ckpts"), timeout=300)
    first = results[0]
    # the estimate: the tensors of a save, each written once over the two replicas; the files add their
    # framing and the small objects (a tenth of this tiny model's files, a rounding error at real sizes)
    assert first["counted"][0] > 0 and first["counted"][1] > 0  # both replicas write a share
    assert 0.8 * first["written"] <= sum(first["counted"]) <= first["written"]
    for result in results:  # every rank raised the same error, naming the fix
        message = result["refused"]
        assert message is not None and message == first["refused"]
        assert "global_step_2/policy" in message and "GiB free" in message and "nothing was written" in message
        assert "trainer.max_ckpts_to_keep" in message and "trainer.ckpt_path" in message
        assert result["left"] == []  # no partial directory left behind
        assert "skyrl_megatron_checkpoint.json" in result["first"]  # the previous checkpoint untouched
        assert "skyrl_megatron_checkpoint.json" in result["second"]  # saved once the set-aside one counted
    assert not os.path.exists(tmp_path / "ckpts" / "global_step_2" / ".policy.partial")


def _writes_failing_with_enospc(rank, world, hf_dir, root):
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver, CheckpointError, save_checkpoint

    built, optimizer, scheduler, micro_batches = setup_training(hf_dir, WORLD1, False)
    train_step(built.chunks, optimizer, scheduler, micro_batches)
    root = Path(root)
    save_checkpoint(root / "kept", built.chunks, optimizer, scheduler, step=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    filesystem_async._write_item = disk_full  # what torch's writer calls for every item
    errors = {}
    try:
        save_checkpoint(root / "kept", built.chunks, optimizer, scheduler, step=2)
    except CheckpointError as exc:
        errors["sync"] = str(exc)
    saver = AsyncCheckpointSaver()
    saver.save(root / "background", built.chunks, optimizer, scheduler, step=2)
    try:
        saver.finalize()
    except CheckpointError as exc:
        errors["async"] = str(exc)
    return {"errors": errors, "kept": sorted(p.name for p in (root / "kept").iterdir()),
            "background": (root / "background").exists()}


def test_a_write_that_fails_names_the_writers_error(tmp_path):
    """Megatron's writer raises `AssertionError: <class 'OSError'>` for a failed write thread; the error says
    what the thread hit, in the foreground and in the background, and publishes nothing."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=5))
    (result,) = run_on_ranks(_writes_failing_with_enospc, 1, hf_dir, str(tmp_path / "ckpts"), timeout=300)
    errors = result["errors"]
    assert "No space left on device" in errors["sync"] and "kept" in errors["sync"], errors
    assert "No space left on device" in errors["async"] and "background" in errors["async"], errors
    assert "the previous checkpoint stays" in errors["sync"] and "the previous checkpoint stays" in errors["async"]
    assert "skyrl_megatron_checkpoint.json" in result["kept"]  # step 1's checkpoint, still published
    assert result["background"] is False


def _exports_against_a_small_disk(rank, world, hf_dir, root):
    import shutil
    from collections import namedtuple

    import torch.distributed as dist

    from skyrl_megatron.checkpoint import CheckpointError, save_hf_model

    built, _, _, _ = setup_training(hf_dir, TP2_SP, False)
    root = Path(root)
    kept = save_hf_model(root / "export", built)  # a first export, with room
    dist.barrier()
    written = sum(p.stat().st_size for p in kept.glob("*.safetensors"))
    Usage = namedtuple("Usage", "total used free")
    real_disk_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: Usage(10 * written, 9 * written, written // 2)  # half of what it writes
    try:
        try:
            save_hf_model(root / "export", built)
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        dist.barrier()
        left = sorted(p.name for p in root.iterdir())
        # the estimate is the export's size, not a multiple of it: a tenth more room than it writes suffices
        shutil.disk_usage = lambda path: Usage(10 * written, 9 * written, int(1.1 * written))
        save_hf_model(root / "export", built)
    finally:
        shutil.disk_usage = real_disk_usage
    return {"written": written, "refused": refused, "left": left, "kept": sorted(p.name for p in kept.iterdir())}


def test_an_hf_export_that_does_not_fit_is_refused_before_gathering(tmp_path):
    """TP2: the shards of each rank add up to the export's size, checked against rank 0's disk."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=6))
    results = run_on_ranks(_exports_against_a_small_disk, 2, hf_dir, str(tmp_path / "exports"), timeout=300)
    first = results[0]
    assert first["written"] > 0
    for result in results:  # every rank raised the same error, naming the fix
        message = result["refused"]
        assert message is not None and message == first["refused"]
        assert "HF export" in message and "GiB free" in message and "nothing was written" in message
        assert "trainer.export_path" in message
        assert result["left"] == ["export"]  # no partial directory beside it
        assert "model.safetensors" in result["kept"] or "model.safetensors.index.json" in result["kept"]
