"""Old checkpoints deleted in the background (`checkpoint.retention`): which steps `max_ckpts_to_keep` retires,
that a save in flight and the newest complete ones are never touched, and that a deletion cut short leaves
nothing under a checkpoint's own name."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from skyrl_megatron.checkpoint import retention
from skyrl_megatron.checkpoint.latest import saved_steps
from skyrl_megatron.checkpoint.retention import BackgroundRetention, being_removed, remove_retired, retired_steps


def _checkpoints(root: Path, *steps: int) -> Path:
    for step in steps:
        (root / f"global_step_{step}" / "policy").mkdir(parents=True)
        (root / f"global_step_{step}" / "policy" / "shard.distcp").write_bytes(b"x" * 64)
    (root / "latest_ckpt_global_step.txt").write_text(str(max(steps)))
    return root


@pytest.mark.parametrize(("keep", "retired"), [(-1, []), (0, [2, 4, 6]), (1, [2, 4]), (2, [2]), (3, []), (5, [])])
def test_the_hosts_meaning_of_max_ckpts_to_keep_over_complete_checkpoints(tmp_path, keep, retired):
    # step 8 is a save in flight: newer than the newest complete one, never counted or deleted
    root = _checkpoints(tmp_path, 2, 4, 6, 8)
    assert retired_steps(root, keep, newest_complete=6) == retired


def test_removal_keeps_the_newest_complete_and_the_save_in_flight(tmp_path):
    root = _checkpoints(tmp_path, 1, 2, 3, 10)
    (root / ".global_step_0.removing").mkdir()  # an earlier process's deletion, cut short
    assert remove_retired(root, keep=1, newest_complete=3) == [1, 2]
    assert saved_steps(root) == [3, 10]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_10", "global_step_3", "latest_ckpt_global_step.txt"]


def test_a_deletion_cut_short_leaves_no_checkpoint_under_its_own_name(tmp_path, monkeypatch):
    root = _checkpoints(tmp_path, 1, 2, 3)

    def killed(path, ignore_errors=False):
        raise SystemExit("killed during the deletion")

    monkeypatch.setattr(retention.shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        remove_retired(root, keep=1, newest_complete=3)
    # the renamed directory is what was left: nothing resumes it, and the next deletion removes it
    assert saved_steps(root) == [3]
    assert [p.name for p in being_removed(root)] == [".global_step_1.removing", ".global_step_2.removing"]
    monkeypatch.undo()
    assert remove_retired(root, keep=1, newest_complete=3) == []
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3", "latest_ckpt_global_step.txt"]


def test_retired_checkpoints_are_set_aside_at_once_and_deleted_in_the_background(tmp_path, monkeypatch):
    root = _checkpoints(tmp_path, 1, 2, 3, 4)
    release = threading.Event()
    deleted = []
    rmtree = shutil.rmtree

    def held(path, *args, **kwargs):
        release.wait(timeout=30)
        deleted.append(Path(path).name)
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(retention.shutil, "rmtree", held)
    cleanup = BackgroundRetention(root, keep=1)
    assert cleanup.start(newest_complete=2) < 1.0  # returns while the deletion is held
    assert saved_steps(root) == [2, 3, 4] and cleanup.removed == [1]  # step 1 no longer looks like a checkpoint
    assert [p.name for p in being_removed(root)] == [".global_step_1.removing"]
    timer = threading.Timer(0.5, release.set)
    timer.start()
    waited = cleanup.start(newest_complete=4)  # waits for the first deletion before the next
    assert waited >= 0.3 and cleanup.removed == [2, 3]
    cleanup.wait()
    assert deleted == [".global_step_1.removing", ".global_step_2.removing", ".global_step_3.removing"]
    assert saved_steps(root) == [4] and not being_removed(root)


def test_keeping_all_starts_nothing(tmp_path):
    root = _checkpoints(tmp_path, 1, 2)
    cleanup = BackgroundRetention(root, keep=-1)
    cleanup.start(newest_complete=2)
    assert cleanup._thread is None and saved_steps(root) == [1, 2]


def test_a_failed_deletion_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    root = _checkpoints(tmp_path, 1, 2)

    def fails(path, *args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(retention.shutil, "rmtree", fails)
    cleanup = BackgroundRetention(root, keep=1)
    cleanup.start(newest_complete=2)
    cleanup.wait()
    assert "deleting checkpoints older than step 2" in caplog.text and "read-only file system" in caplog.text
    assert saved_steps(root) == [2]  # set aside all the same: never resumed
