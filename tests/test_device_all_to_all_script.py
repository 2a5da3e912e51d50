"""bench/gpu_device_all_to_all_check.py on CPU: its smoke mode end to end (2 gloo ranks, the NVSHMEM
op's stand-in), which must fail when the product's regrouping is wrong, and its exit codes. Checks the
script before device time is spent on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_device_all_to_all_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_device_all_to_all_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_exit_codes():
    check = _load()
    assert check.summarize({"ranks": [{"nvshmem_available": False}, {"nvshmem_available": False}]})[0] == 2
    ok = {case: {"outputs_equal": True} for case in check.PARITY}
    rank = {"rank": 0, "received_rows": [3], "capacity_rows": 8, **ok}
    assert check.summarize({"ranks": [rank, rank | {"rank": 1}]})[0] == 0
    bad = rank | {"rank": 1, "parity": {"outputs_equal": False}}
    assert check.summarize({"ranks": [rank, bad]})[0] == 1


@pytest.mark.slow
def test_smoke_mode_on_two_gloo_ranks(tmp_path, bench_smoke):
    out = tmp_path / "dat.json"
    run = bench_smoke(SCRIPT, out, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "all hold" in run.stdout
    for r in json.loads(out.read_text())["ranks"]:
        for case in ("parity_small", "parity", "parity_after_back_to_back"):
            assert r[case] and all(r[case].values()), (case, r[case])
        assert all(0 < rows < r["capacity_rows"] for rows in r["received_rows"])  # padding exercised


@pytest.mark.slow
def test_smoke_mode_catches_a_wrong_regroup(tmp_path, bench_smoke):
    out = tmp_path / "dat.json"
    # rows left in the order they landed (source rank, then expert)
    patch = ("import torch; from skyrl_megatron.model.moe import device_all_to_all as d; "
             "d.chunk_gather_index = lambda sizes, order, capacity: torch.arange(capacity)")
    run = bench_smoke(SCRIPT, out, patch, timeout=180)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-5000:]
    assert "MISMATCH" in run.stdout
