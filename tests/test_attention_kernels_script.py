"""bench/gpu_attention_kernels.py (issue 18: flash-attn-4's Hopper kernels against the model's varlen path) on the
CPU: its packed batch, its fp32 reference and its report, with the model's CPU attention path as the kernel, so the
GPU run cannot fail on the script itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_attention_kernels as script  # noqa: E402


def test_packed_lengths_fill_the_budget_within_bounds():
    lengths = script.packed_lengths(8192, 256, 4096)
    assert sum(lengths) == 8192 and max(lengths) <= 4096 and min(lengths[:-1]) >= 256


def test_causal_flops_count_half_the_square_of_each_sequence():
    # one sequence of 4 tokens, 1 head of dim 2: QK^T and PV over 4*4/2 pairs, 2 FLOPs per multiply-add
    assert script.causal_flops([4], heads=1, head_dim=2) == 2 * 2 * 8 * 2


def test_smoke_run_reports_the_cpu_path_exact_against_the_reference(tmp_path):
    out = tmp_path / "attention.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["shapes"]["tiny"]["kernels"].values()
    assert "error" not in row, row
    # fp32 masked SDPA over the packed batch against fp32 SDPA per sequence: the same numbers up to rounding
    for name in ("out", "dq", "dk", "dv"):
        assert row["errors"][name]["max"] < 1e-4, (name, row["errors"][name])
    assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0
