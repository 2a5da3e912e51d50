"""bench/async_save_capture.py on CPU (`--tiny`): the script a GPU call runs takes its saves and reports them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_the_capture_bench_times_each_save_and_its_parts(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "async_save_capture.py"), "--tiny", "--layers", "2", "--saves", "3",
         "--phases", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saves = re.findall(r"^save (\d): capture ([\d.]+) ms", result.stdout, flags=re.MULTILINE)
    assert [index for index, _ in saves] == ["0", "1", "2"] and all(float(ms) > 0 for _, ms in saves)
    (phases,) = [line for line in result.stdout.splitlines() if line.startswith("per save and training step")]
    for part in ("_copy_ahead", "save_state_dict_async_plan", "_stage", "release"):
        assert f" {part} " in phases, phases
    # each save replaced the last: one checkpoint on the disk
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf") == ["ckpt"]
