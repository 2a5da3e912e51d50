"""Checkpoint saves leave no process behind: a rank SIGKILLed in the middle of a save takes every
process the save started with it, and a completed save has started none."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from skyrl_megatron.testing import run_on_ranks
from test_checkpoint import _tiny_gpt

pytestmark = pytest.mark.slow

WRITING = "writing shards"
# The child imports this module from its own directory and starts a save that hangs in the writer.
_SAVE_UNTIL_KILLED = "import sys, test_checkpoint_writers as t; t._save_until_killed(sys.argv[1])"


def _save_until_killed(ckpt_dir: str) -> None:
    """Child process: save a checkpoint whose shard writer announces itself, then hangs."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from skyrl_megatron.checkpoint import save_checkpoint

    def hang(*args, **kwargs):
        print(WRITING, flush=True)
        time.sleep(600)

    # Megatron prepares everything a save needs (and would start its helpers) before any writing.
    FileSystemWriterAsync.write_preloaded_data = staticmethod(hang)
    save_checkpoint(ckpt_dir, [_tiny_gpt()], step=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_saver(ckpt_dir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    with open(log, "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", _SAVE_UNTIL_KILLED, str(ckpt_dir)],
            cwd=Path(__file__).parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _alive_after(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those of `processes` still running `seconds` from now (or as soon as none is)."""
    deadline = time.monotonic() + seconds
    while any(map(_running, processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [process for process in processes if _running(process)]


def test_a_rank_killed_mid_save_leaves_no_process_behind(tmp_path):
    log = tmp_path / "saver.log"
    with _start_saver(tmp_path / "ckpt", log) as saver:
        watchdog = threading.Timer(120, saver.kill)  # a save that never reaches the writer fails, not hangs
        watchdog.start()
        try:
            reached_writer = any(line.strip() == WRITING for line in saver.stdout)
            # taken before the kill: afterwards the orphans are no longer the saver's descendants
            descendants = psutil.Process(saver.pid).children(recursive=True) if reached_writer else []
        finally:
            watchdog.cancel()
            saver.kill()
    assert reached_writer, f"the save never reached the shard writer:\n{log.read_text()[-3000:]}"

    survivors = _alive_after(descendants, seconds=5)
    for process in survivors:  # do not leak them into the rest of the session
        process.kill()
    assert not survivors, [(process.pid, process.cmdline()) for process in survivors]


def _save_and_load(rank, world_size, ckpt_dir):
    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint

    model = _tiny_gpt()
    saved = {name: param.detach().clone() for name, param in model.named_parameters()}
    save_checkpoint(ckpt_dir, [model], step=3)
    processes_after_save = [child.cmdline() for child in psutil.Process().children(recursive=True)]
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    state = load_checkpoint(ckpt_dir, [model])
    restored = all(torch.equal(param, saved[name]) for name, param in model.named_parameters())
    return processes_after_save, state.step, restored


def test_a_save_starts_no_process_and_loads_back(tmp_path):
    ((processes_after_save, step, restored),) = run_on_ranks(_save_and_load, 1, str(tmp_path / "ckpt"), timeout=120)
    assert processes_after_save == []
    assert step == 3 and restored
